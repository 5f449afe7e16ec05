"""The command line: flags to an engine configuration and a server configuration. Imported by ``app/__main__.py``
and by ``cluster/``, which passes the same flags to every replica."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from app.server.browser_guard import is_loopback
from app.server.limits import RequestLimits
from app.server.state import ServerConfig
from app.stores.file_store import default_data_dir
from engine.core.config import DEFAULT_MODEL, EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.models = chat_models(parser, args)
    args.model = args.models[0][1]
    _check_cluster(parser, args)
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key (or $SMOLSERVE_API_KEY) is empty: give a key, or leave it unset to serve without one")
    return args


def chat_models(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[tuple[str, ...] | None, str]]:
    """The chat models to serve, in order: each one's names (None: its own) and its source. ``--served-model-name``
    names the one model (all its names), or each of several (one name each)."""
    sources = list(args.model or [])
    if args.models_dir:
        folder = Path(args.models_dir)
        if not folder.is_dir():
            parser.error(f"--models-dir {folder}: not a directory")
        sources += sorted(str(path) for path in folder.glob("*.gguf") if str(path) not in sources)
    sources = sources or [DEFAULT_MODEL]
    names = args.served_model_name
    if names is None:
        return [(None, source) for source in sources]
    if len(sources) == 1:
        return [(tuple(names), sources[0])]
    if len(names) != len(sources):
        parser.error(f"--served-model-name: {len(names)} names for {len(sources)} chat models (one each)")
    return [((name,), source) for name, source in zip(names, sources, strict=True)]


def build_parser() -> argparse.ArgumentParser:
    """Every flag, with its default and help (docs/operating.md's table is checked against it)."""
    parser = argparse.ArgumentParser(prog="python -m app", description="OpenAI-compatible completions server")
    _model_flags(parser)
    _engine_flags(parser, EngineConfig())
    _path_flags(parser, EngineConfig())
    _server_flags(parser, ServerConfig())
    _security_flags(parser)
    _pool_flags(parser, ServerConfig())
    _file_flags(parser, ServerConfig())
    _cluster_flags(parser)
    return parser


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="a chat model: .gguf file, HF model dir, hub id, 'fake', or the bundled default (the default); give it "
        "again for more models, each loaded when first asked for (the first at start)",
    )
    parser.add_argument(
        "--models-dir",
        default=None,
        metavar="DIR",
        help="serve every .gguf file in DIR too (after the --model ones, by name), each loaded when first asked for",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients send as `model` for the chat model (default: the model's); the first is reported. With "
        "several chat models: one name per model, in their order",
    )
    parser.add_argument(
        "--embedding-model",
        default="default",
        metavar="PATH|none",
        help="the sentence-embedding model served beside it at /v1/embeddings: a sentence-transformers folder or HF "
        "directory; default: the bundled all-MiniLM-L6-v2; none: no embedding model",
    )
    parser.add_argument(
        "--embedding-model-name", nargs="+", default=None, metavar="NAME", help="names of the embedding model"
    )


def _engine_flags(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=defaults.dtype,
        help="weights and activations; auto: bfloat16 where the CPU computes it natively (AVX512-BF16, AMX, Arm "
        "BF16, read from /proc/cpuinfo), else float32",
    )
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size, help="sequences per step")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion")
    parser.add_argument("--kv-cache-gib", type=float, default=defaults.kv_cache_gib, help="KV cache memory bound")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8"],
        default=defaults.kv_cache_dtype,
        help="auto: the model's dtype; int8: half of bfloat16's memory, faster decode at long contexts (CPU)",
    )
    parser.add_argument(
        "--quantization",
        choices=["auto", "native", "int8", "none"],
        default=defaults.quantization,
        help="native: a GGUF model's weights multiplied in their blocks (docs/operating.md lists the architectures and "
        "types); int8: linear weights quantized per output channel at load; none: dense --dtype weights; auto: native "
        "for a GGUF the native path reads, else none",
    )
    parser.add_argument(
        "--threads",
        type=_threads,
        default=None,
        metavar="N|auto",
        help="threads of the engine's one team; auto (default): the CPUs this process may use (affinity mask, "
        "cgroup CPU quota), fewer while other processes keep some of them busy; N: exactly N",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not keep computed prompt and answer blocks for later requests that start the same way",
    )
    parser.add_argument(
        "--kv-disk-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the prefix cache keeps full KV blocks on disk, found again after a restart, an unload or an "
        "eviction (default: kv-cache under --data-dir)",
    )
    parser.add_argument(
        "--kv-disk-gib",
        type=float,
        default=defaults.kv_disk_gib,
        help="what the prefix cache's blocks on disk may take, per model (least recently used dropped; 0: none)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="tokens per forward step; long prompts are prefilled in chunks of this size",
    )


def _path_flags(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    """How each step computes: one numeric path or the fastest, and speculative decoding."""
    parser.add_argument(
        "--batch-invariant",
        choices=["auto", "on", "off"],
        default=defaults.batch_invariant,
        help="on: a row's result never depends on its batchmates (one numeric path); off: the fastest path for "
        "each step; auto: on for a model served from its GGUF blocks; for a dense one, on unless its tiles cost 5%% "
        "or more of the throughput at --max-batch-size (measured here)",
    )
    parser.add_argument(
        "--speculative",
        choices=["auto", "ngram", "none"],
        default=defaults.speculative,
        help="speculative decoding from prompt lookup (drafts from the prompt and the text so far; greedy output "
        "stays bitwise the same while batch invariance holds): ngram always; auto where a step's expected tokens "
        "per second beat no drafts (each sequence's acceptance so far against the step's cost, measured here); "
        "none never",
    )


def _server_flags(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    parser.add_argument("--max-queue", type=int, default=defaults.max_queue, help="waiting requests before 429")
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.limits.max_request_bytes,
        help="largest request body accepted (413 beyond, decided before the body is read)",
    )
    parser.add_argument(
        "--kv-cache-idle-release",
        type=float,
        default=defaults.kv_cache_idle_release_s,
        metavar="SECONDS",
        help="idle time after which the KV cache's memory is handed back if the prefix cache holds nothing",
    )
    parser.add_argument(
        "--max-embedding-inputs",
        type=int,
        default=defaults.max_embedding_inputs,
        metavar="N",
        help="inputs one /v1/embeddings request may carry (a 400 beyond)",
    )
    parser.add_argument(
        "--responses-store-size",
        type=int,
        default=defaults.responses_store_size,
        metavar="N",
        help="responses kept for previous_response_id and GET /v1/responses/{id} (least recently used leave first; "
        "0 keeps none)",
    )
    parser.add_argument(
        "--responses-store-bytes",
        type=int,
        default=defaults.responses_store_bytes,
        help="what the stored responses may hold together (least recently used leave first)",
    )
    parser.add_argument(
        "--sse-keepalive",
        type=float,
        default=None,
        metavar="SECONDS",
        help="send an SSE comment line (': ping') on a stream quiet for this long (default: never, as OpenAI)",
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM"
    )
    parser.add_argument("--log-level", default="info")


def _security_flags(parser: argparse.ArgumentParser) -> None:
    """Who may call the server (docs/operating.md, "Security and bounds")."""
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SMOLSERVE_API_KEY"),
        help="require `Authorization: Bearer <key>` on every route but /health and /metrics (default: "
        "$SMOLSERVE_API_KEY)",
    )
    parser.add_argument(
        "--cors-origins", nargs="*", default=[], help="web origins allowed by CORS, e.g. '*' (others are refused)"
    )
    parser.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=None,
        metavar="NAME",
        help="Host names accepted besides the loopback ones while bound to a loopback address (421 for others: "
        "DNS rebinding); bound elsewhere, the only names accepted if given",
    )


def _pool_flags(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    """Several chat models in one server (``app/services/model_pool.py``)."""
    parser.add_argument(
        "--keep-alive",
        type=float,
        default=defaults.keep_alive_s,
        metavar="SECONDS",
        help="with several chat models: unload one idle this long (-1: never; 0: as soon as it is idle)",
    )
    parser.add_argument(
        "--max-loaded-models",
        type=int,
        default=defaults.max_loaded_models,
        metavar="N",
        help="with several chat models: the most loaded at once; loading another unloads the least recently used "
        "idle one (default: no bound)",
    )


def _file_flags(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    """Uploaded files (``app/stores/file_store.py``)."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where uploaded files (/v1/files) and their database are kept (default: $XDG_DATA_HOME/smolserve, "
        "~/.local/share/smolserve)",
    )
    parser.add_argument(
        "--max-file-bytes",
        type=int,
        default=defaults.max_file_bytes,
        help="largest file one upload to /v1/files may hold (413 beyond)",
    )
    parser.add_argument(
        "--max-data-bytes",
        type=int,
        default=defaults.max_data_bytes,
        help="what all files under --data-dir may hold together, uploads and batch outputs (507 beyond)",
    )
    parser.add_argument(
        "--max-concurrent-uploads",
        type=int,
        default=defaults.max_concurrent_uploads,
        metavar="N",
        help="uploads received at once (429 beyond)",
    )


def _cluster_flags(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("scaling out on Ray Serve (any of these starts the cluster mode)")
    cluster.add_argument("--replicas", type=int, default=None, help="engine replicas (each one engine, its own KV)")
    cluster.add_argument("--min-replicas", type=int, default=None, help="autoscale between this and --max-replicas")
    cluster.add_argument("--max-replicas", type=int, default=None)
    cluster.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (e.g. 10.0.0.1:6379) instead of starting one"
    )
    cluster.add_argument(
        "--replica-cpus", type=float, default=None, help="CPUs each replica reserves (default: this machine's / max)"
    )


def _check_cluster(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.min_replicas is None) != (args.max_replicas is None):
        parser.error("--min-replicas and --max-replicas go together")
    for name in ("replicas", "min_replicas", "max_replicas"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "min_replicas" else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least {0 if name == 'min_replicas' else 1}")
    if args.min_replicas is not None and args.min_replicas > args.max_replicas:
        parser.error("--min-replicas must not exceed --max-replicas")
    if clustered(args) and len(args.models) > 1:
        parser.error("--replicas serves one chat model (each replica holds its engine): start a cluster per model")


def _threads(value: str) -> int | None:
    """``--threads``: ``auto`` (None) or a positive count."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of threads or 'auto', not {value!r}")
    return int(value)


def clustered(args: argparse.Namespace) -> bool:
    """Whether the flags ask for Ray Serve; without them the server is one process and never imports Ray."""
    return any(v is not None for v in (args.replicas, args.min_replicas, args.ray_address))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        kv_cache_dtype=args.kv_cache_dtype,
        prefix_caching=args.prefix_caching,
        kv_disk_dir=str(args.kv_disk_dir or (args.data_dir or default_data_dir()) / "kv-cache"),
        kv_disk_gib=args.kv_disk_gib,
        quantization=args.quantization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.threads,
        batch_invariant=args.batch_invariant,
        speculative=args.speculative,
        embedding_model=args.embedding_model,
    )


def _allowed_hosts(bound: str, names: list[str] | None) -> tuple[str, ...] | None:
    """Bound to a loopback address: the loopback names and ``names``; elsewhere ``names`` if given, else any."""
    if is_loopback(bound):
        return tuple(names or ())
    return None if names is None else (*names, bound)


def server_config(args: argparse.Namespace) -> ServerConfig:
    first = args.models[0][0]
    return ServerConfig(
        served_model_name=first[0] if first else None,
        model_aliases=tuple(first[1:]) if first else (),
        keep_alive_s=args.keep_alive,
        max_loaded_models=args.max_loaded_models,
        data_dir=args.data_dir,
        max_file_bytes=args.max_file_bytes,
        max_data_bytes=args.max_data_bytes,
        max_concurrent_uploads=args.max_concurrent_uploads,
        embedding_model_names=tuple(args.embedding_model_name or ()),
        max_embedding_inputs=args.max_embedding_inputs,
        max_queue=args.max_queue,
        kv_cache_idle_release_s=args.kv_cache_idle_release,
        api_key=args.api_key,
        cors_origins=tuple(args.cors_origins),
        allowed_hosts=_allowed_hosts(args.host, args.allowed_hosts),
        sse_keepalive_s=args.sse_keepalive,
        limits=RequestLimits(max_request_bytes=args.max_request_bytes),
        responses_store_size=args.responses_store_size,
        responses_store_bytes=args.responses_store_bytes,
    )
