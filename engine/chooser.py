"""Build the engine and tokenizer a config names. Heavy backends are imported only when chosen."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core import cpu, speculation
from engine.core.architectures import config_value
from engine.core.batch_mode import BatchMode, PathTimes, choose
from engine.core.config import EngineConfig
from engine.core.encoder import Encoder, FakeEncoder
from engine.core.fake_engine import FakeEngine
from engine.core.seam import InferenceEngine
from engine.core.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:  # both import torch, which is loaded only when a HF model is chosen
    from engine.core.thread_governor import ThreadGovernor
    from engine.runtime.kv_disk import DiskSpec
    from engine.runtime.loader import LoadedModel
    from engine.runtime.quantized_weights import QuantizedWeight

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedModel:
    name: str
    engine: InferenceEngine
    tokenizer: Tokenizer
    #: The thread the engine was built on, for its steps to run on too (``None``: any thread will do).
    engine_thread: ThreadPoolExecutor | None = None
    #: The sentence-embedding model served beside it, run on the same thread; None when there is none.
    encoder: Encoder | None = None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def build(config: EngineConfig, engine_thread: ThreadPoolExecutor | None = None) -> ServedModel:
    """The model ``config`` names, ready to serve. ``engine_thread``: the thread of the models already served,
    which this one's steps share (a model loaded later, on the calling thread, which should exit once it is built
    so that its torch thread team goes with it); None: a thread of its own, which builds it too."""
    if config.model == "fake":
        engine = FakeEngine(
            capacity=config.max_batch_size,
            max_model_len=config.max_model_len or 2048,
            speculative=config.speculative == "ngram",  # auto: nothing measured, no drafts
        )
        encoder = FakeEncoder() if config.embedding_model == "default" else build_encoder(config.embedding_model)
        return ServedModel("fake", engine, ByteTokenizer(), encoder=encoder)
    # Every torch call of a HF engine, from loading to the last step, runs on one thread: each thread that
    # enters torch's OpenMP gets its own team of workers, and with a second team on this 2-core machine a
    # decode step ran ~2x slower, even with the first team idle.
    if engine_thread is not None:
        return _build_hf(config, engine_thread)
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    return engine_thread.submit(_build_hf, config, engine_thread).result()


def _build_hf(config: EngineConfig, engine_thread: ThreadPoolExecutor) -> ServedModel:
    from engine.core.heap import trim_heap
    from engine.runtime import gguf_model, loader
    from engine.runtime.batch_engine import HFEngine

    governor = thread_team(config)
    loaded = loader.load(config.model, config.dtype, blocks=serves_blocks(config))
    quantized = quantized_weights(loaded, config.quantization)
    times = probe_paths(loaded, quantized, config)
    mode = choose(config.batch_invariant, times, config.max_batch_size, blocks_only=_has_experts(loaded.model))
    log.info("%s", mode.describe())
    drafts = speculation.choose(config.speculative, times, mode.invariant, config.max_num_batched_tokens)
    log.info("speculative decoding: %s", "none" if drafts is None else drafts.describe())
    if loaded.blocks and mode.dense_from_rows is not None:
        log.info("dense copy of the blocks in memory: steps from %d rows run dense", mode.dense_from_rows)
        gguf_model.densify(loaded.model, loaded.blocks)
    max_model_len = fitted_context(loaded.model, config, loaded.max_position_embeddings)
    hf_engine = HFEngine(
        loaded.model,
        eos_token_ids=loaded.eos_token_ids,
        capacity=config.max_batch_size,
        max_model_len=max_model_len,
        kv_cache_bytes=int(config.kv_cache_gib * 2**30),
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_dtype=config.kv_cache_dtype,
        prefix_caching=config.prefix_caching,
        quantized=quantized,
        batch_mode=mode,
        governor=governor,
        draft_rows=drafts,
        kv_disk=disk_spec(config, loaded, _prefill_per_token(times, mode)),
        file_keys=_file_keys(loaded.gguf),
    )
    tokenizer = HFTokenizer(loaded.tokenizer, loaded.eos_token_ids)
    served = ServedModel(loaded.name, hf_engine, tokenizer, engine_thread, build_encoder(config.embedding_model))
    # The engine runs on its own (prepacked) copies of the weights; the loaded model is freed here, and
    # without a trim glibc kept its ~280 MB resident (RSS after start-up: 1057 MiB, trimmed 778 MiB).
    del loaded
    trim_heap()
    return served


def disk_spec(config: EngineConfig, loaded: LoadedModel, prefill_per_token: float | None = None) -> DiskSpec | None:
    """The prefix cache's disk tier as ``config`` asks for it, within half the disk's free space; None: none.
    ``prefill_per_token``: what the start-up probe says a prefill costs a token, for the tier's first choice between
    reading a block and prefilling it."""
    from engine.runtime.kv_disk import DiskSpec, file_identity

    if config.kv_disk_dir is None or config.kv_disk_gib <= 0:
        return None
    directory = Path(config.kv_disk_dir)
    directory.mkdir(parents=True, exist_ok=True)
    wanted = int(config.kv_disk_gib * 2**30)
    room = shutil.disk_usage(directory).free // 2
    if room < wanted:
        log.info("KV disk tier: %.1f GiB asked, %.1f GiB (half the disk's free space) taken", wanted / 2**30,
                 room / 2**30)  # fmt: skip
    config_digest = hashlib.sha256(loaded.model.config.to_json_string().encode()).hexdigest()
    source = file_identity(str(loaded.gguf) if loaded.gguf is not None else config.model)
    identity = {**source, "config": config_digest, "quantization": config.quantization}
    return DiskSpec(directory, min(wanted, room), identity, prefill_per_token)


def _file_keys(gguf: Path | None) -> dict[str, Any]:
    """A GGUF's keys as its description gives them: numbers, strings and short arrays (a vocabulary's and the chat
    template, given apart, left out)."""
    from engine.runtime.gguf_file import GGUFFile

    if gguf is None:
        return {}
    keys = GGUFFile(gguf).keys
    return {
        key: value
        for key, value in keys.items()
        if isinstance(value, int | float | str | list) and not key.startswith("tokenizer.chat_template")
    }


def _prefill_per_token(times: PathTimes | None, mode: BatchMode) -> float | None:
    """The probe's matmul seconds per row at the most rows it timed, on the path a prefill step takes there."""
    if times is None:
        return None
    dense = not mode.invariant and mode.dense_from_rows is not None
    return (times.dense if dense else times.invariant)[-1] / times.rows[-1]


def fitted_context(model: Any, config: EngineConfig, trained: int) -> int:
    """The positions a sequence is served: ``--max-model-len`` (at most the model's ``trained`` context), or, where
    it is not given, the model's context, shrunk to what ``--kv-cache-gib`` holds for one sequence (gpt-oss's 131,072
    positions take 6 GiB at float32: as llama.cpp fits its context to memory, said in the log). A given length too
    long for the cache is refused by the engine, naming both."""
    from engine.core.config import BLOCK_SIZE
    from engine.runtime.batch_engine import kv_cache_blocks

    if config.max_model_len:
        return min(config.max_model_len, trained)
    blocks = kv_cache_blocks(model, int(config.kv_cache_gib * 2**30), config.kv_cache_dtype, BLOCK_SIZE)
    held = (blocks - 1) * BLOCK_SIZE  # the engine keeps a block's room beyond one sequence
    if held >= trained:
        return trained
    log.warning(
        "the model's context of %d positions does not fit --kv-cache-gib %g (%d positions): serving %d a sequence "
        "(--max-model-len, --kv-cache-gib or --kv-cache-dtype int8 to choose)",
        trained, config.kv_cache_gib, blocks * BLOCK_SIZE, max(held, BLOCK_SIZE),
    )  # fmt: skip
    return max(held, BLOCK_SIZE)


def quantized_weights(loaded: LoadedModel, quantization: str) -> dict[str, QuantizedWeight] | None:
    """The matrices to multiply in quantized blocks for ``--quantization`` (``None``: all dense): ``native``, a
    GGUF's own Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks; ``int8``, every linear layer quantized per output channel now; ``auto``,
    ``native`` where it can serve (a GGUF llama on the CPU, native kernels built), else none."""
    from engine.runtime import gguf_weights, kernels
    from engine.runtime.model_runner import LlamaRunner
    from engine.runtime.quantized_weights import int8_weights

    if quantization == "none":
        return None
    if loaded.blocks is not None:  # read as blocks: a llama GGUF on the CPU, the native kernels built
        return loaded.blocks or None if quantization == "auto" else loaded.blocks
    model = loaded.model
    servable = LlamaRunner.supports(model) and model.device.type == "cpu" and kernels.native_ops() is not None
    config = model.config
    if quantization == "auto":
        if not servable or loaded.gguf is None:
            return None
        return (
            gguf_weights.read(loaded.gguf, config.num_attention_heads, config_value(config, "num_key_value_heads"))
            or None
        )
    if not servable:
        raise ValueError(
            f"--quantization {quantization} needs a llama-architecture model on the CPU and the native CPU kernels "
            "(a C++ compiler)"
        )
    if quantization == "int8":
        return int8_weights(model)
    if loaded.gguf is None:
        raise ValueError("--quantization native serves a GGUF model's own blocks; this model is not a GGUF")
    return gguf_weights.read(loaded.gguf, config.num_attention_heads, config_value(config, "num_key_value_heads"))


def serves_blocks(config: EngineConfig) -> bool:
    """Whether a llama GGUF is read as its blocks (no dense conversion): the quantized path, on the CPU."""
    from engine.runtime import kernels

    return config.quantization in ("auto", "native") and kernels.native_ops() is not None


def thread_team(config: EngineConfig) -> ThreadGovernor | None:
    """Size this (the engine's) thread's team: ``--threads``, or the process's CPUs; with ``auto``, the governor
    that resizes it as other processes take or leave CPUs (None when pinned)."""
    import torch

    from engine.core.thread_governor import ThreadGovernor

    threads = team_size(config)
    torch.set_num_threads(threads)
    cpus = len(os.sched_getaffinity(0))
    how = "--threads" if config.threads else (
        f"auto: {cpus} CPUs in the affinity mask, capped by the cgroup's CPU quota and OMP_NUM_THREADS "
        f"({os.environ.get('OMP_NUM_THREADS', 'unset')}); fewer while other processes keep some busy"
    )  # fmt: skip
    log.info("threads: %d (%s)", threads, how)
    if config.threads:
        return None
    return ThreadGovernor(threads, cpus, cpu.NeighbourMeter().sample, torch.set_num_threads)


def team_size(config: EngineConfig) -> int:
    """``--threads``; or the process's CPU budget, capped by ``OMP_NUM_THREADS`` where the environment sets it (as
    a cluster's replica does: its share of the machine)."""
    if config.threads:
        return config.threads
    budget = cpu.cpu_budget()
    env = os.environ.get("OMP_NUM_THREADS", "")
    return min(budget, int(env)) if env.isdigit() and int(env) > 0 else budget


def probe_paths(
    loaded: LoadedModel, quantized: dict[str, QuantizedWeight] | None, config: EngineConfig
) -> PathTimes | None:
    """The probe's times of both matmul paths on this CPU, by rows, for ``--batch-invariant`` and
    ``--speculative`` (for the lean llama runner on the CPU; None for other models: no choice to make)."""
    from engine.runtime import gguf_model, probe_store
    from engine.runtime.model_runner import LlamaRunner
    from engine.runtime.path_probe import probe, probed

    model = loaded.model
    if not (LlamaRunner.supports(model) and model.device.type == "cpu"):
        return None
    if _has_experts(model):  # no dense twin of its experts to time: the blocks serve every step
        log.info("mixture of experts: every step multiplies the experts' blocks (no dense copy to choose)")
        return None
    key = _probe_key(config, model, loaded.gguf)
    if key in _PROBED:
        log.info("%s (measured at this model's first load)", _PROBED[key].describe())
        return _PROBED[key]
    kept = probe_store.load(key)
    if kept is not None:
        log.info("%s (kept from this file's first start on this CPU: %s)", kept.describe(), probe_store.directory())
        _PROBED[key] = kept
        return kept
    if loaded.blocks:  # the probe times the dense path on the first layer's and the output layer's values
        gguf_model.densify(model, loaded.blocks, [n for n in loaded.blocks if n.startswith(probed(model))])
    times = _PROBED[key] = probe(model, quantized, config.max_batch_size)
    log.info("%s", times.describe())
    probe_store.save(key, times)
    return times


#: Each model's probe times, by all they depend on, for the life of the process: a model unloaded and loaded again
#: (``--keep-alive``, Ollama's ``keep_alive: 0``) takes what its first load measured, instead of 2-5 s of probing
#: again, and so the same numeric path as before (which its blocks on disk are named by).
_PROBED: dict[str, PathTimes] = {}


def _probe_key(config: EngineConfig, model: Any, gguf: Path | None) -> str:
    """The model file (path, size, mtime), its dtype, quantization, batch size and the thread team's size."""
    import torch

    from engine.runtime.kv_disk import file_identity

    key = [file_identity(str(gguf) if gguf is not None else config.model), str(model.dtype), config.quantization,
           config.max_batch_size, torch.get_num_threads()]  # fmt: skip
    return repr(key)


def _has_experts(model: Any) -> bool:
    """A mixture-of-experts model of the lean runner (``Architecture.experts``)."""
    from engine.core.architectures import by_model_type

    arch = by_model_type(model.config.model_type)
    return arch is not None and arch.mixture(model.config)


def build_encoder(spec: str) -> Encoder | None:
    """The embedding model ``spec`` names (``default``: the bundled all-MiniLM-L6-v2), on the calling thread."""
    if spec == "none":
        return None
    from pathlib import Path

    from engine.runtime.encoder import DEFAULT_NAME, SentenceEncoder, default_path

    if spec == "default":
        return SentenceEncoder(default_path(), DEFAULT_NAME)
    return SentenceEncoder(spec, Path(spec).resolve().name)


def context_length(source: str, max_model_len: int | None) -> int | None:
    """A model's context length before it is loaded, where its file says it (a GGUF's ``{arch}.context_length``),
    capped by ``--max-model-len``; None where it is known only once loaded."""
    from engine.runtime.gguf_file import GGUFFile

    path = Path(source)
    if path.suffix != ".gguf" or not path.is_file():
        return max_model_len
    try:
        keys = GGUFFile(path).keys
        trained = int(keys[f"{keys['general.architecture']}.context_length"])
    except (KeyError, ValueError, OSError):
        return max_model_len
    return min(trained, max_model_len or trained)


def served_name(source: str) -> str:
    """The name a model is served under, known before it is loaded (as the loader names it): a GGUF file's stem,
    a folder's name, a hub id or the default's name as given."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem
    return path.resolve().name if path.is_dir() else source
