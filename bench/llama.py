"""llama.cpp's ``llama-server`` on the default GGUF, the reference the benchmarks compare against
(``../shared/tools/build-llama-server.sh`` builds it and prints its path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compat.conftest import free_port, wait_until_healthy  # noqa: E402
from engine.core.config import DEFAULT_GGUF  # noqa: E402


def start_llama(
    binary: str,
    slots: int,
    context: int = 256,
    threads: int = 2,
    extra: list[str] | tuple[str, ...] = (),
    gguf: Path | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """llama.cpp's server on ``gguf`` (the default GGUF when None), ``threads`` threads, ``slots`` sequences of
    ``context`` positions each, and ``extra`` flags. Where its weight repacking crashes at start (Intel AMX
    machines), again with ``--no-repack``."""
    package, filename = DEFAULT_GGUF
    gguf = gguf or next((ROOT / ".venv").glob(f"lib/python*/site-packages/{package}/{filename}"))
    for repack in ([], ["--no-repack"]):
        port = free_port()
        cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-c", str(slots * context), "-t", str(threads), "-cb", *extra, *repack]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until_healthy(proc, base, 300)
        except RuntimeError:
            if repack:
                raise
            continue
        return proc, base
    raise AssertionError("unreachable")
