"""The start-up probe's times kept on disk, per model file, CPU and kernels: a model's second start takes what its
first measured instead of timing its matmuls again (a 7B's probe: ~14 s of a 24 s start on two cores).

One JSON file a probe under ``$SMOLSERVE_CACHE_DIR/probes`` (``engine/runtime/loader.py``'s cache), named by a
digest of all the times depend on: the file (path, size, modification time), dtype, quantization, batch size,
thread team, the CPU (model name and flags, as the native build is named) and the sources of the kernels and the
probe. A change to any of them measures again; so does deleting the folder (to re-time a machine whose neighbours
were busy at the first start). Keeping the first start's times also keeps its choices (``--batch-invariant
auto``'s dense crossover, speculation's row budget) from start to start, where timing again could land either side
of a margin by chance.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from engine.core.batch_mode import PathTimes
from engine.runtime.kernels import cpu_tag, source_digest

log = logging.getLogger(__name__)

_PROBE_SOURCE = Path(__file__).parent / "path_probe.py"


def directory() -> Path:
    from engine.runtime.loader import cache_dir

    return cache_dir() / "probes"


def _path(key: str) -> Path:
    probe = hashlib.sha256(_PROBE_SOURCE.read_bytes()).hexdigest()
    digest = hashlib.sha256("\n".join((key, cpu_tag(), source_digest(), probe)).encode()).hexdigest()[:24]
    return directory() / f"{digest}.json"


def load(key: str) -> PathTimes | None:
    """The times a start with ``key`` measured on this CPU and these kernels; None where none are kept (or the file
    is unreadable: measured again)."""
    path = _path(key)
    try:
        kept = json.loads(path.read_text())
        return PathTimes(tuple(kept["rows"]), tuple(kept["invariant"]), tuple(kept["dense"]), bool(kept["quantized"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the kept probe times %s are unreadable (%s): measuring again", path, exc)
        return None


def save(key: str, times: PathTimes) -> None:
    """Keep ``times`` for the next start (written whole, then renamed: a start that reads never sees half a file).
    A cache that cannot be written costs only the next start's probe."""
    path = _path(key)
    body = {"key": key, "rows": times.rows, "invariant": times.invariant, "dense": times.dense,
            "quantized": times.quantized}  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
            json.dump(body, handle)
        os.replace(handle.name, path)
    except OSError as exc:
        log.warning("could not keep the probe's times in %s: %s", path.parent, exc)
