"""The prefix cache's disk tier (``engine/runtime/kv_disk.py``): a prefix computed by one engine is read back from
disk by the next (a restart, an unload) instead of prefilled, with greedy tokens and logprobs bitwise those of a
fresh prefill; files torn or corrupt are removed and never used; another model or configuration never reads
them; the folder stays within its bound."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from engine_helpers import make_engine, prompt_ids, run_outputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine import chooser
from engine.core.config import EngineConfig
from engine.core.types import GenerationRequest, TokenLogprob
from engine.runtime.batch_engine import HFEngine
from engine.runtime.kv_disk import DiskSpec

EOS = frozenset({7})


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir)


def engine_on(model: PreTrainedModel, folder: Path | None, kv: str = "auto", **identity: object) -> HFEngine:
    spec = None if folder is None else DiskSpec(folder, 1 << 30, {"model": "tiny", **identity})
    return make_engine(model, EOS, kv_cache_dtype=kv, kv_disk=spec)  # type: ignore[arg-type]


def answer(engine: HFEngine, prompt: tuple[int, ...], tokens: int = 6) -> tuple[list[TokenLogprob], int]:
    """Greedy tokens with their logprobs (and 3 alternatives), and the prompt tokens the cache gave."""
    request = GenerationRequest(prompt, max_new_tokens=tokens, ignore_eos=True, logprobs=3)
    cached: list[int] = []
    original = engine.planner.commit

    def commit(plan, next_tokens):  # type: ignore[no-untyped-def]
        outputs = original(plan, next_tokens)
        cached.extend(out.cached_tokens for out in outputs if out.cached_tokens is not None)
        return outputs

    engine.planner.commit = commit  # type: ignore[method-assign]
    produced = run_outputs(engine, [(0, request)])[0]
    engine.planner.commit = original  # type: ignore[method-assign]
    return produced, cached[0]


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_a_prefix_is_read_back_after_a_restart_to_the_same_bits(tiny: PreTrainedModel, tmp_path: Path,
                                                                 kv: str) -> None:  # fmt: skip
    prompt = prompt_ids(1, 150)
    fresh, cached = answer(engine_on(tiny, None, kv), prompt)
    assert cached == 0
    first = engine_on(tiny, tmp_path, kv)
    assert answer(first, prompt) == (fresh, 0)
    first.close()  # an unload or a stop: what was queued is written
    assert len(list(tmp_path.rglob("*.kv"))) == 150 // 16 + (6 - 1 + 150 % 16) // 16
    second = engine_on(tiny, tmp_path, kv)
    assert answer(second, prompt) == (fresh, 144)  # 9 whole blocks of the 149 positions before the last
    disk = second.memory_stats().disk
    assert disk is not None and disk["hit_tokens"] == 144 and disk["restored_blocks"] == 9
    # A longer prompt that starts the same way: the blocks from disk, then its own.
    longer = prompt + prompt_ids(2, 40)
    assert answer(engine_on(tiny, tmp_path, kv), longer) == (answer(engine_on(tiny, None, kv), longer)[0], 144)


def test_torn_and_corrupt_files_are_removed_never_used(tiny: PreTrainedModel, tmp_path: Path) -> None:
    prompt = prompt_ids(3, 100)
    fresh, _ = answer(engine_on(tiny, None), prompt)
    first = engine_on(tiny, tmp_path)
    answer(first, prompt)
    first.close()
    files = sorted(tmp_path.rglob("*.kv"), key=lambda path: path.stat().st_mtime_ns)
    assert len(files) == 6
    data = bytearray(files[3].read_bytes())
    data[-5] ^= 0x40  # one bit of the fourth block's keys and values
    files[3].write_bytes(bytes(data))
    torn = files[0].with_name("00" * 16 + ".tmp")
    torn.write_bytes(b"SMOLKV01")  # a write a kill -9 cut short
    second = engine_on(tiny, tmp_path)
    assert not torn.exists()
    assert answer(second, prompt) == (fresh, 48)  # the three blocks before the corrupt one
    assert second.memory_stats().disk["corrupt_files"] == 1  # type: ignore[index]
    second.close()
    assert files[3].read_bytes() != bytes(data)  # removed, then written again whole by the prefill
    files[4].write_bytes(files[4].read_bytes()[:-1])  # cut short: not even listed at start
    third = engine_on(tiny, tmp_path)
    assert answer(third, prompt) == (fresh, 64)  # the fourth block, prefilled again and written by the second


def test_another_configuration_never_reads_the_blocks(tiny: PreTrainedModel, tmp_path: Path) -> None:
    prompt = prompt_ids(4, 80)
    first = engine_on(tiny, tmp_path)
    answer(first, prompt)
    first.close()
    assert answer(engine_on(tiny, tmp_path, "int8"), prompt)[1] == 0  # another KV dtype
    assert answer(engine_on(tiny, tmp_path, source="another"), prompt)[1] == 0  # another model file
    assert answer(engine_on(tiny, tmp_path), prompt)[1] == 64


def test_the_folder_stays_within_its_bound(tiny: PreTrainedModel, tmp_path: Path) -> None:
    engine = engine_on(tiny, None)
    block_file = 32 + engine.cache.block_bytes()
    bounded = make_engine(tiny, EOS, kv_disk=DiskSpec(tmp_path, 10 * block_file, {}))  # type: ignore[arg-type]
    for seed in range(12):
        answer(bounded, prompt_ids(10 + seed, 40), tokens=2)
        bounded.disk.flush()  # type: ignore[union-attr]
        assert sum(path.stat().st_size for path in tmp_path.rglob("*.kv")) <= 10 * block_file
    bounded.close()
    # The most recent prompts' blocks are the ones kept.
    assert answer(make_engine(tiny, EOS, kv_disk=DiskSpec(tmp_path, 10 * block_file, {})),  # type: ignore[arg-type]
                  prompt_ids(21, 40))[1] == 32  # fmt: skip


def test_blocks_are_read_only_while_a_read_is_faster_than_a_prefill(tiny: PreTrainedModel, tmp_path: Path) -> None:
    """The tier times a read at start and each prefill step of 64 rows or more; while prefilling a block is the
    faster (a slow disk beside a fast CPU), a newcomer's prefix is prefilled, not read, to the same answer."""
    prompt = prompt_ids(50, 150)
    fresh = answer(engine_on(tiny, None), prompt)[0]
    writer = engine_on(tiny, tmp_path)
    assert writer.disk is not None and writer.disk.read_seconds > 0 and writer.disk.prefill_seconds is None
    answer(writer, prompt)
    writer.close()
    assert writer.disk.prefill_seconds is not None and writer.disk.prefill_seconds > 0
    slow = engine_on(tiny, tmp_path)
    assert slow.disk is not None
    slow.disk.prefill_seconds, slow.disk.read_seconds = 1e-3, 1.0  # as a network disk measures against this CPU
    assert answer(slow, prompt) == (fresh, 0)
    stats = slow.memory_stats().disk
    assert stats is not None and stats["lookups_skipped"] == 1 and stats["restored_blocks"] == 0
    fast = engine_on(tiny, tmp_path)
    fast.disk.prefill_seconds, fast.disk.read_seconds = 1.0, 1e-3  # type: ignore[union-attr]
    assert answer(fast, prompt) == (fresh, 144)


def test_servers_sharing_a_folder_read_each_other_s_blocks_and_keep_one_bound(
    tiny: PreTrainedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas over one ``--data-dir``, both up: a prefix one wrote is read by the other, which started
    before it was written; a temporary file a live writer holds is left alone at start, a dead one's removed; each
    writer takes in the other's files before it evicts, so the folder stays within the bound whoever wrote."""
    from engine.runtime import kv_disk

    monkeypatch.setattr(kv_disk, "_RESCAN_SECONDS", 0.0)
    block_file = 32 + engine_on(tiny, None).cache.block_bytes()
    spec = DiskSpec(tmp_path, 8 * block_file, {})
    one = make_engine(tiny, EOS, kv_disk=spec)  # type: ignore[arg-type]
    other = make_engine(tiny, EOS, kv_disk=spec)  # type: ignore[arg-type]
    prompt = prompt_ids(30, 70)
    fresh = answer(engine_on(tiny, None), prompt)[0]
    assert answer(one, prompt)[1] == 0
    one.disk.flush()  # type: ignore[union-attr]
    assert answer(other, prompt) == (fresh, 64)
    folder = next(tmp_path.iterdir())
    live = folder / f"{'11' * 16}.{os.getpid()}.tmp"
    dead = folder / f"{'22' * 16}.{_dead_pid()}.tmp"
    live.write_bytes(b"SMOLKV02 being written")
    dead.write_bytes(b"SMOLKV02 cut short")
    make_engine(tiny, EOS, kv_disk=spec).close()  # type: ignore[arg-type]
    assert live.exists() and not dead.exists()
    live.unlink()
    for seed in range(6):  # 2 blocks a prompt, in turn on each
        engine = (one, other)[seed % 2]
        answer(engine, prompt_ids(40 + seed, 40), tokens=2)
        engine.disk.flush()  # type: ignore[union-attr]
        assert sum(path.stat().st_size for path in tmp_path.rglob("*.kv")) <= 8 * block_file
    one.close()
    other.close()


def _dead_pid() -> int:
    """A process id no process has now: a child that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shared=st.integers(17, 120), own=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       seed=st.integers(0, 50))  # fmt: skip
def test_any_prefix_from_disk_answers_as_a_fresh_prefill(
    tiny: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory, shared: int, own: list[int], seed: int
) -> None:
    """Prompts sharing a start of any length, written by one engine, each read back by the next: the same bits."""
    folder = tmp_path_factory.mktemp("kv")
    start = prompt_ids(seed, shared)
    prompts = [start + prompt_ids(seed + 1 + i, n) for i, n in enumerate(own)]
    writer = engine_on(tiny, folder)
    answer(writer, prompts[0])
    writer.close()
    reader = engine_on(tiny, folder)
    for prompt in prompts:
        produced, cached = answer(reader, prompt)
        assert produced == answer(engine_on(tiny, None), prompt)[0]
        assert cached >= min(shared, len(prompts[0]) - 1) // 16 * 16


def test_the_served_model_with_default_flags_reads_its_blocks_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundled model as ``make serve`` builds it (its GGUF blocks, native kernels, batch invariance): a
    prompt's second run, on a new engine over the same folder (a restart: nothing kept in the process), takes its
    prefix from disk, to the same bits; the second start takes the first's matmul probe from disk instead of probing
    again."""
    from engine.runtime import path_probe, probe_store

    probes: list[int] = []
    real_probe = path_probe.probe
    monkeypatch.setattr(probe_store, "directory", lambda: tmp_path / "probes")
    monkeypatch.setattr(path_probe, "probe", lambda *args, **kw: probes.append(1) or real_probe(*args, **kw))
    prompt = tuple(range(1000, 1400))
    runs = []
    for _ in range(2):
        monkeypatch.setattr(chooser, "_PROBED", {})
        served = chooser.build(EngineConfig(kv_disk_dir=str(tmp_path)))
        disk = served.engine.memory_stats().disk  # type: ignore[union-attr]
        assert disk is not None and disk["prefill_seconds_per_block"] > 0  # the start-up probe's, before a step
        runs.append(answer(served.engine, prompt, tokens=8))  # type: ignore[arg-type]
        served.engine.close()
    assert runs[0][1] == 0 and runs[1] == (runs[0][0], 384)
    assert len(probes) == 1
