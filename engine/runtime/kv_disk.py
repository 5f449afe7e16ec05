"""The prefix cache's disk tier: full KV blocks kept in files, so that an agent's long prefix survives a restart, an
unload or the pool's evictions (``engine/core/blocks.py``'s ``LowerTier``).

A block is one file, ``<directory>/<fingerprint>/<hash>.kv``: a header (a magic, the payload's length and its
CRC-32) and the block's bytes as ``BlockKVCache.read_block`` gives them. The fingerprint names everything
the bytes depend on (the model file's identity and config, dtypes, block size, quantization, the numeric path,
the CPU the kernels were built for and the engine's own code), so a block is never read by another model or
configuration. Each full block the prefix cache learns is copied on the engine thread (a memory copy); a step's
blocks go together to a thread of its own, which runs only on an idle CPU (helped by a second at nice 19 while
more than 64 MB wait) and writes each to a temporary name (its process's) then renames it: a file is whole or
absent; a torn temporary one whose writer is gone is removed at start, and a file whose checksum does not match is
removed when read, never used. With 256 MB of blocks waiting, newer ones are dropped (a step never waits on the
disk). The tier holds at most ``max_bytes`` (room is made before a file is written), least recently written or
read dropped first; its index is rebuilt from the folder at start, oldest first by modification time.

A hybrid model's recurrent states go to a tier of their own (a folder named by the same fingerprint and "states"):
the state at a prompt's last block end, a file a prompt (``RecurrentStates``' bytes: a checkpoint's convolution
inputs and matrices), so that a restarted server resumes a hybrid's prefix at the last block whose state it finds.

A block is read instead of prefilled while that is faster: the tier times a read of a block (a file written and
read back at start, then each restore, as a moving average) against the engine's prefill per block (the start-up
probe's matmuls per row at first, then each step of at least ``PREFILL_ROWS`` rows), and while prefilling is the
faster (a slow or network disk beside a fast CPU) the prefix cache does not look below memory.

Several servers on one machine (replicas, or a restart beside a draining server) may share a folder: a block one
wrote is found by the others (a block missing from the index is looked for on disk), each writes under its own
temporary names, and each writer takes in the folder's files again every ``_RESCAN_SECONDS`` before it evicts, so
the folder holds what the largest bound allows, whoever wrote it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

_MAGIC = b"SMOLKV02"
_CHECKSUM = 4
_HEADER = len(_MAGIC) + 8 + _CHECKSUM
#: Blocks copied but not yet written, at most (then the newest are dropped).
_MAX_PENDING_BYTES = 256 * 2**20
#: Blocks waiting past these bytes: a second writer takes a small share of busy CPUs too (the first is behind).
_CATCH_UP_BYTES = 64 * 2**20
#: The steps whose time per row is taken as a prefill's (fewer rows: a step's fixed costs weigh too much).
PREFILL_ROWS = 64
#: The weight of the newest measurement in the read's and the prefill's moving averages.
_AVERAGE = 0.2
#: How often a writer takes in the files other processes wrote to the same folder (for the bound).
_RESCAN_SECONDS = 30.0
#: A temporary file older than this is torn whoever wrote it (a write takes milliseconds).
_STALE_SECONDS = 600.0
#: The engine's own code whose change may change a block's bytes.
_CODE = [Path(__file__).parent, Path(__file__).parent / "csrc"]


class Blocks(Protocol):
    """What the tier keeps, as runs of bytes of one size: the KV cache's blocks (``BlockKVCache``), or a hybrid's
    recurrent states (``RecurrentStates``: a checkpoint's bytes, read into a sequence's slot)."""

    block_size: int

    def block_bytes(self) -> int: ...

    def read_block(self, block: int) -> torch.Tensor: ...

    def write_block(self, block: int, data: torch.Tensor) -> None: ...


def to_bytes(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts``' elements as one run of bytes, copied, one part after another (``from_bytes`` takes them back)."""
    return torch.cat([part.contiguous().view(torch.uint8).flatten() for part in parts])


def from_bytes(data: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Write ``parts`` (views into a pool) from the bytes ``to_bytes`` made of parts of their shapes and types."""
    offset = 0
    for part in parts:
        count = part.numel() * part.element_size()
        run = data[offset : offset + count]
        if run.storage_offset() % part.element_size():
            run = run.clone()  # a view as a wider type must start at a multiple of its size
        part.copy_(run.view(part.dtype).view(part.shape))
        offset += count


@dataclass(slots=True, frozen=True)
class DiskSpec:
    """Where a model's blocks go on disk, how much they may take, and what they depend on besides the engine's
    own choices (``identity``: the model's file and config)."""

    directory: Path
    max_bytes: int
    identity: dict[str, Any] = field(default_factory=dict)
    #: The start-up probe's matmul seconds per row of a prefill step (None: not probed; reads until a step says).
    prefill_seconds_per_token: float | None = None


def fingerprint(identity: dict[str, Any]) -> str:
    """What a block's bytes depend on, as a name: ``identity`` (the model and the engine's choices) with this
    engine's code."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    for folder in _CODE:
        for source in sorted(folder.iterdir()):
            if source.suffix in (".py", ".cpp", ".h"):
                digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:32]


def file_identity(source: str) -> dict[str, Any]:
    """A model source's identity: its path, size and modification time (a folder: its config's)."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        stat = path.stat()
    except OSError:
        return {"source": source}
    return {"source": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class DiskTier:
    def __init__(
        self, cache: Blocks, directory: Path, max_bytes: int, name: str, prefill_per_token: float | None = None,
        timed: bool = True,
    ) -> None:  # fmt: skip
        """``timed``: a read is timed at start (against a prefill's cost, ``pays``); a hybrid's states' tier is not
        (the KV blocks' tier decides; a state is read where its blocks were)."""
        self.cache = cache
        self.directory = directory / name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.block_bytes = cache.block_bytes()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = self._scan()  # hash -> file bytes, least recent first
        self._bytes = sum(self._index.values())
        self._scanned = time.monotonic()
        self._queued: set[bytes] = set()
        self._step: list[tuple[bytes, torch.Tensor]] = []  # this step's blocks, handed over together
        self._pending: queue.Queue[list[tuple[bytes, torch.Tensor]] | None] = queue.Queue()
        self._pending_blocks = 0
        self._max_pending = max(1, _MAX_PENDING_BYTES // self.block_bytes)
        self.stats = {"restored_blocks": 0, "restore_seconds": 0.0, "written_blocks": 0,
                      "dropped_writes": 0, "corrupt_files": 0, "lookups_skipped": 0}  # fmt: skip
        #: Seconds to read a block in, and to prefill one (None: not known yet), as moving averages.
        self.timed = timed
        self.read_seconds = self._time_a_read() if timed else 0.0
        self.prefill_seconds = None if prefill_per_token is None else prefill_per_token * cache.block_size
        self._reserved = 0  # bytes of files being written: counted in _bytes, not yet in the index
        self._reserve(0)  # a smaller bound than the last start's
        self._behind = threading.Event()  # more than _CATCH_UP_BYTES wait
        self._closing = False
        self._writers = [threading.Thread(target=self._write_all, name="kv-disk", daemon=True),
                         threading.Thread(target=self._catch_up, name="kv-disk-catch-up", daemon=True)]  # fmt: skip
        for writer in self._writers:
            writer.start()

    # -- the LowerTier -------------------------------------------------------------------------------------

    def pays(self) -> bool:
        """Whether reading a block in is faster than prefilling it, as last measured (unknown: reading is)."""
        if self.prefill_seconds is None or self.read_seconds < self.prefill_seconds:
            return True
        self.stats["lookups_skipped"] += 1
        return False

    def observe_prefill(self, rows: int, seconds: float) -> None:
        """A step of ``rows`` rows took ``seconds``: the prefill's cost per block, if the step was a prefill's."""
        if rows >= PREFILL_ROWS:
            self.prefill_seconds = _averaged(self.prefill_seconds, seconds / rows * self.cache.block_size)

    def has(self, digest: bytes) -> bool:
        """In the index, or written since by another process sharing the folder (then taken into the index)."""
        with self._lock:
            if digest in self._index:
                return True
        try:
            size = self._path(digest).stat().st_size
        except OSError:
            return False
        if size != _HEADER + self.block_bytes:
            return False
        with self._lock:
            if digest not in self._index:
                self._index[digest] = size
                self._bytes += size
        return True

    def load(self, digest: bytes, block: int) -> bool:
        started = time.perf_counter()
        path = self._path(digest)
        try:
            payload = self._read(path)
            os.utime(path)  # recency survives a restart
        except OSError:
            self._drop(digest)
            return False
        if payload is None:
            log.warning("KV disk tier: %s is torn or corrupt; removed, not used", path.name)
            self.stats["corrupt_files"] += 1
            self._drop(digest, unlink=True)
            return False
        self.cache.write_block(block, torch.frombuffer(payload, dtype=torch.uint8))
        with self._lock:
            if digest in self._index:
                self._index.move_to_end(digest)
        seconds = time.perf_counter() - started
        self.stats["restored_blocks"] += 1
        self.stats["restore_seconds"] += seconds
        self.read_seconds = _averaged(self.read_seconds, seconds)
        return True

    def store(self, digest: bytes, block: int) -> None:
        self.store_bytes(digest, lambda: self.cache.read_block(block))

    def store_bytes(self, digest: bytes, copy: Callable[[], torch.Tensor]) -> None:
        """Keep ``copy()``'s bytes (a copy the caller no longer writes, made only if they are to be written) as
        ``digest``'s, off the caller's thread."""
        with self._lock:
            if digest in self._index or digest in self._queued:
                return
            if self._pending_blocks + len(self._step) >= self._max_pending:
                self.stats["dropped_writes"] += 1
                return
            self._queued.add(digest)
        self._step.append((digest, copy()))

    def end_step(self) -> None:
        """Hand this step's blocks to the writer at once: it wakes once a step, not once a block (each time it
        runs it takes a core from the engine's thread team, which then waits for it)."""
        if self._step:
            with self._lock:
                self._pending_blocks += len(self._step)
                behind = self._pending_blocks * self.block_bytes > _CATCH_UP_BYTES
            self._pending.put(self._step)
            self._step = []
            if behind:
                self._behind.set()

    # -- the rest ------------------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """For ``/health``, ``/metrics`` and the start-up summary (a states' tier: no tokens or timings of its own:
        its "blocks" are states, each at the end of blocks the KV blocks' tier counts)."""
        with self._lock:
            held = {"blocks": len(self._index), "bytes": self._bytes}
        described = {"directory": str(self.directory), "max_bytes": self.max_bytes, **held, **self.stats}
        if not self.timed:
            return described
        hits = self.stats["restored_blocks"] * self.cache.block_size  # each block restored is a newcomer's
        return {**described, "hit_tokens": hits, "read_seconds_per_block": self.read_seconds,
                "prefill_seconds_per_block": self.prefill_seconds}  # fmt: skip

    def flush(self) -> None:
        """Wait until every block copied so far is written."""
        self.end_step()
        self._pending.join()

    def close(self) -> None:
        """Write what is queued, then stop the writers."""
        self.end_step()
        self._closing = True
        self._pending.put(None)
        self._behind.set()
        for writer in self._writers:
            writer.join()

    def _write_all(self) -> None:
        """The writer: it runs only on a CPU nothing else wants (Linux's ``SCHED_IDLE`` for this thread), so that
        the engine's threads are not the ones that wait."""
        _set_priority(idle=True)
        while (blocks := self._pending.get()) is not None:
            self._write_batch(blocks)
        self._pending.task_done()

    def _catch_up(self) -> None:
        """The second writer, at nice 19 (a small share of a busy CPU), for while more than ``_CATCH_UP_BYTES``
        wait (a CPU busy with prefills has no idle time for the first, which may not be let back from ``SCHED_IDLE``:
        an unprivileged thread is not), and for all that waits once the tier closes (an unload beside a busy model
        must not wait for an idle CPU)."""
        _set_priority(idle=False)
        while True:
            self._behind.wait()
            self._behind.clear()
            while self._closing or self._pending_blocks * self.block_bytes > _CATCH_UP_BYTES // 2:
                try:
                    blocks = self._pending.get_nowait()
                except queue.Empty:
                    break
                if blocks is None:  # the first writer's to take, once all before it is written
                    self._pending.task_done()
                    self._pending.put(None)
                    return
                self._write_batch(blocks)
            if self._closing:
                return

    def _write_batch(self, blocks: list[tuple[bytes, torch.Tensor]]) -> None:
        try:
            for digest, data in blocks:
                self._write(digest, data)
        except OSError as exc:  # a full or read-only disk: those blocks are not kept
            log.warning("KV disk tier: blocks were not written: %s", exc)
        finally:
            with self._lock:
                self._pending_blocks -= len(blocks)
                self._queued.difference_update(digest for digest, _ in blocks)
            self._pending.task_done()

    def _write(self, digest: bytes, data: torch.Tensor) -> None:
        """The block's file, written once the folder has room for it within the bound (so it never holds more)."""
        payload = data.numpy()
        size = _HEADER + len(payload)
        if time.monotonic() - self._scanned > _RESCAN_SECONDS:
            self._rescan()
        if not self._reserve(size):
            return
        header = _MAGIC + len(payload).to_bytes(8, "little") + _checksum(payload)
        path = self._path(digest)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")  # one writer a block: a name a process
        try:
            with open(temporary, "wb") as handle:
                handle.write(header)
                handle.write(memoryview(payload))
            os.replace(temporary, path)
        except OSError:
            with self._lock:
                self._bytes -= size
                self._reserved -= size
            temporary.unlink(missing_ok=True)
            raise
        with self._lock:
            self._reserved -= size
            if digest in self._index:  # a rescan found the file already, and counted it
                self._bytes -= size
            self._index[digest] = size
        self.stats["written_blocks"] += 1

    def _rescan(self) -> None:
        """Take in the folder's files as they are now (other processes' writes and evictions), by recency."""
        found = self._scan()
        with self._lock:
            self._index = found
            self._bytes = sum(found.values()) + self._reserved
            self._scanned = time.monotonic()

    def _reserve(self, size: int) -> bool:
        """Room for a file of ``size`` bytes within the bound, the least recently used files removed for it, counted
        at once (under the lock: two writers never count the same room twice); False where a block is more than
        the bound."""
        with self._lock:
            if size > self.max_bytes:
                return False
            while self._bytes + size > self.max_bytes and self._index:
                digest, held = self._index.popitem(last=False)
                self._bytes -= held
                self._path(digest).unlink(missing_ok=True)
            self._bytes += size
            self._reserved += size
        return True

    def _drop(self, digest: bytes, unlink: bool = False) -> None:
        with self._lock:
            size = self._index.pop(digest, None)
            if size is not None:
                self._bytes -= size
        if unlink:
            self._path(digest).unlink(missing_ok=True)

    def _time_a_read(self) -> float:
        """A block's read as a restore reads it (the file, its checksum, a copy into a block's bytes): the best of
        three, on the most recent block here, or, in an empty folder, on a file written for it (a file more would
        take the folder past its bound)."""
        with self._lock:
            newest = next(reversed(self._index), None)
        if newest is not None:
            with contextlib.suppress(OSError):  # (removed meanwhile by a server sharing the folder)
                return self._best_read(self._path(newest))
        payload = bytes(self.block_bytes)
        path = self.directory / f"probe.{os.getpid()}.tmp"
        try:
            path.write_bytes(_MAGIC + len(payload).to_bytes(8, "little") + _checksum(payload) + payload)
            return self._best_read(path)
        finally:
            path.unlink(missing_ok=True)

    def _best_read(self, path: Path) -> float:
        scratch = torch.empty(self.block_bytes, dtype=torch.uint8)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            payload = self._read(path)
            if payload is not None:  # (a corrupt file is found so by its restore)
                scratch.copy_(torch.frombuffer(payload, dtype=torch.uint8))
            best = min(best, time.perf_counter() - started)
        return best

    def _read(self, path: Path) -> memoryview | None:
        """A block file's payload, if whole and as written (``_payload``); OSError where it cannot be read."""
        raw = bytearray(_HEADER + self.block_bytes + 1)  # one more: a longer file does not fit
        with open(path, "rb") as handle:
            length = handle.readinto(raw)
        return _payload(memoryview(raw)[:length], self.block_bytes)

    def _path(self, digest: bytes) -> Path:
        return self.directory / f"{digest.hex()}.kv"

    def _scan(self) -> OrderedDict[bytes, int]:
        """The files here, least recently used first; torn temporary files (whose writer is gone) removed."""
        found: list[tuple[int, bytes, int]] = []
        for entry in os.scandir(self.directory):
            name = entry.name
            if name.endswith(".tmp"):
                if _torn(entry):
                    Path(entry.path).unlink(missing_ok=True)
                continue
            try:
                digest = bytes.fromhex(name.removesuffix(".kv"))
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            if name.endswith(".kv") and stat.st_size == _HEADER + self.block_bytes:
                found.append((stat.st_mtime_ns, digest, stat.st_size))
        return OrderedDict((digest, size) for _, digest, size in sorted(found))


def _set_priority(idle: bool) -> None:
    """The calling thread at nice 19 and, if ``idle``, on ``SCHED_IDLE`` (it never preempts a thread of the
    engine's team: at nice 19 alone the writer, woken each step, cost 32 decoding streams ~5% of their tokens a
    second)."""
    thread = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, thread, 19)
    if idle:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))


def _averaged(average: float | None, value: float) -> float:
    return value if average is None else (1 - _AVERAGE) * average + _AVERAGE * value


def _torn(entry: os.DirEntry[str]) -> bool:
    """A temporary file no process is writing: its writer (the process named in it) is gone, or it is stale."""
    try:
        if time.time() - entry.stat().st_mtime > _STALE_SECONDS:
            return True
        _, named, _ = entry.name.split(".")  # <hash>.<pid>.tmp
        pid = int(named)
    except (OSError, ValueError):
        return True  # no writer named: an older tier's
    if pid <= 0:
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _payload(raw: memoryview, size: int) -> memoryview | None:
    """A file's payload, if whole and as written (its length and digest); else None."""
    if len(raw) != _HEADER + size or raw[: len(_MAGIC)] != _MAGIC:
        return None
    if int.from_bytes(raw[len(_MAGIC) : len(_MAGIC) + 8], "little") != size:
        return None
    payload = raw[_HEADER:]
    if _checksum(payload) != raw[_HEADER - _CHECKSUM : _HEADER]:
        return None
    return payload


def _checksum(payload: Any) -> bytes:
    """CRC-32 (zlib's): a torn or flipped file is told from a whole one at several GB/s."""
    return zlib.crc32(payload).to_bytes(_CHECKSUM, "little")
