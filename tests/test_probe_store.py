"""The start-up probe's times kept on disk (``engine/runtime/probe_store.py``): a second start reads what the first
measured, only for the same file, settings, CPU and kernels; a damaged or unwritable cache costs a probe, never a
start."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.batch_mode import PathTimes
from engine.runtime import probe_store

TIMES = PathTimes((1, 2, 128), (0.0823, 0.0991, 3.7055), (0.2193, 0.2192, 2.0926), True)
KEY = repr([{"source": "/models/a.gguf", "size": 4683070912, "mtime_ns": 1}, "torch.bfloat16", "auto", 128, 2])


@pytest.fixture(autouse=True)
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(probe_store, "directory", lambda: tmp_path / "probes")
    return tmp_path / "probes"


def test_a_second_start_reads_the_first_start_s_times_bit_for_bit() -> None:
    assert probe_store.load(KEY) is None
    probe_store.save(KEY, TIMES)
    assert probe_store.load(KEY) == TIMES


def test_another_file_setting_cpu_or_kernel_build_measures_again(monkeypatch: pytest.MonkeyPatch) -> None:
    probe_store.save(KEY, TIMES)
    assert probe_store.load(KEY.replace("4683070912", "4683070913")) is None  # the file changed
    assert probe_store.load(KEY.replace("128, 2]", "128, 1]")) is None  # one thread
    cpu_tag, source_digest = probe_store.cpu_tag, probe_store.source_digest
    monkeypatch.setattr(probe_store, "cpu_tag", lambda: "another-cpu")
    assert probe_store.load(KEY) is None
    monkeypatch.setattr(probe_store, "cpu_tag", cpu_tag)
    monkeypatch.setattr(probe_store, "source_digest", lambda: "other-kernels")
    assert probe_store.load(KEY) is None
    monkeypatch.setattr(probe_store, "source_digest", source_digest)
    assert probe_store.load(KEY) == TIMES


def test_a_damaged_file_is_measured_again_and_replaced(store: Path, caplog: pytest.LogCaptureFixture) -> None:
    probe_store.save(KEY, TIMES)
    (kept,) = store.glob("*.json")
    kept.write_text('{"rows": [1, 2')
    assert probe_store.load(KEY) is None
    assert "unreadable" in caplog.text
    probe_store.save(KEY, TIMES)
    assert probe_store.load(KEY) == TIMES
    assert not list(store.glob("*.tmp"))


def test_a_cache_that_cannot_be_written_costs_only_the_next_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(probe_store, "directory", lambda: blocked / "probes")
    probe_store.save(KEY, TIMES)  # no exception
    assert probe_store.load(KEY) is None
