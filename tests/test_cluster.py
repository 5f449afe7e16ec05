"""The Ray Serve mode's parts without a Ray instance: the routing policy, the deployment options the flags make,
the config file, the remote stream's endings and the relabelled metrics. The live cluster is
``compat/test_ray_cluster.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from app.server.cli import clustered, parse_args
from app.services.backend import LocalBackend, Submission
from cluster.backend import RayBackend, RemoteStream, _ReplicaCollector
from cluster.deployments import app_builder, engine_options, flags
from cluster.replica import Accepted, Failed, Rejected
from cluster.routing import PrefixAffinity
from engine.core.block_pool import prefix_hashes
from engine.core.scheduler import QueueFullError
from engine.core.streams import Delta, EngineError
from engine.core.types import GenerationRequest
from tests.app_helpers import fake_client

ROOT = Path(__file__).resolve().parent.parent


def hashes(*tokens: int) -> list[bytes]:
    return prefix_hashes(list(tokens), 1)


# -- the routing policy ---------------------------------------------------------------------------------------


def test_a_prompt_nobody_holds_goes_to_the_least_loaded() -> None:
    policy = PrefixAffinity(imbalance=4)
    assert policy.choose(hashes(1, 2, 3), {"a": 5, "b": 2, "c": 9}) == [["b", "a", "c"]]
    assert policy.choose([], {"a": 1, "b": 0}) == [["b", "a"]]


def test_the_replica_holding_the_longest_prefix_comes_first() -> None:
    policy = PrefixAffinity(imbalance=4)
    policy.record("a", hashes(1, 2))
    policy.record("b", hashes(1, 2, 3, 4))
    assert policy.choose(hashes(1, 2, 3, 9), {"a": 0, "b": 3, "c": 0})[0] == ["b"]
    assert policy.choose(hashes(1, 2, 7), {"a": 1, "b": 0, "c": 2})[0] == ["b"]  # equal match: less loaded
    assert policy.choose(hashes(5, 2, 3), {"a": 0, "b": 0, "c": 0})[0] != ["b"]  # chained: block 1 differs


def test_a_cache_key_goes_back_to_the_replica_that_took_it() -> None:
    policy = PrefixAffinity(imbalance=4)
    policy.record("a", hashes(1, 2, 3, 4))
    policy.record("b", hashes(1, 9), key="session-1")
    # The key's replica beats a longer match elsewhere, and holds a prompt no one has seen.
    assert policy.choose(hashes(1, 2, 3, 4), {"a": 0, "b": 1}, key="session-1")[0] == ["b"]
    assert policy.choose(hashes(7), {"a": 0, "b": 1, "c": 0}, key="session-1")[0] == ["b"]
    # Another key (or none) routes by the prefix; an overloaded key replica loses the key's claim.
    assert policy.choose(hashes(1, 2, 3, 4), {"a": 0, "b": 0}, key="session-2")[0] == ["a"]
    assert policy.choose(hashes(1, 2, 3, 4), {"a": 0, "b": 0})[0] == ["a"]
    assert policy.choose(hashes(7), {"a": 0, "b": 4}, key="session-1") == [["a", "b"]]


def test_an_overloaded_replica_loses_its_affinity() -> None:
    policy = PrefixAffinity(imbalance=4)
    policy.record("a", hashes(1, 2, 3))
    assert policy.choose(hashes(1, 2, 3), {"a": 3, "b": 0}) == [["a"], ["b", "a"]]  # a little busier: stay
    assert policy.choose(hashes(1, 2, 3), {"a": 9, "b": 6}) == [["a"], ["b", "a"]]  # all busy alike
    assert policy.choose(hashes(1, 2, 3), {"a": 9, "b": 5}) == [["b", "a"]]  # 4 ahead: the least loaded


def test_a_replica_that_left_is_forgotten_and_memory_is_bounded() -> None:
    policy = PrefixAffinity(max_blocks_per_replica=3)
    policy.record("a", hashes(1, 2, 3))
    policy.record("b", hashes(1, 2, 3))
    policy.keep_only({"b"})
    assert policy.matched_blocks("a", hashes(1, 2, 3)) == 0
    policy.record("b", hashes(7, 8))
    assert policy.matched_blocks("b", hashes(7, 8)) == 2
    assert policy.matched_blocks("b", hashes(1, 2, 3)) == 0  # its oldest block went first


@given(
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 40), min_size=1),
    st.lists(st.tuples(st.sampled_from("abcdef"), st.lists(st.integers(0, 3), max_size=5))),
    st.lists(st.integers(0, 3), max_size=6),
)
def test_every_choice_ends_with_every_replica_least_loaded_first(
    loads: dict[str, int], history: list[tuple[str, list[int]]], prompt: list[int]
) -> None:
    policy = PrefixAffinity(imbalance=4)
    for replica, tokens in history:
        policy.record(replica, hashes(*tokens))
    ranks = policy.choose(hashes(*prompt), loads)
    assert sorted(ranks[-1]) == sorted(loads)
    assert [loads[r] for r in ranks[-1]] == sorted(loads.values())
    if len(ranks) == 2:
        (best,) = ranks[0]
        assert policy.matched_blocks(best, hashes(*prompt)) == max(
            policy.matched_blocks(r, hashes(*prompt)) for r in loads
        )


# -- flags, options, the config file -------------------------------------------------------------------------


def test_only_cluster_flags_start_the_cluster_mode() -> None:
    assert not clustered(parse_args([]))
    assert clustered(parse_args(["--replicas", "1"]))
    assert clustered(parse_args(["--ray-address", "10.0.0.1:6379"]))
    assert clustered(parse_args(["--min-replicas", "1", "--max-replicas", "4"]))
    for bad in (["--replicas", "0"], ["--min-replicas", "1"], ["--min-replicas", "3", "--max-replicas", "2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_each_replica_takes_its_batch_and_queue_and_the_router_is_ours() -> None:
    options = engine_options(parse_args(["--replicas", "3", "--max-batch-size", "32", "--max-queue", "10"]))
    assert options["num_replicas"] == 3
    assert options["max_ongoing_requests"] == 42 and options["max_queued_requests"] == 10
    router = options["request_router_config"]
    assert router.request_router_class == "cluster.router:PrefixAffinityRouter"
    assert options["ray_actor_options"]["num_cpus"] >= 1


def test_autoscaling_targets_half_a_batch_per_replica() -> None:
    options = engine_options(parse_args(["--min-replicas", "1", "--max-replicas", "4", "--max-batch-size", "64"]))
    assert "num_replicas" not in options
    scaling = options["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 4, 32)


def test_the_serve_config_file_means_the_same_flags() -> None:
    config = yaml.safe_load((ROOT / "cluster/serve.yaml").read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "cluster.deployments:app_builder"
    args = parse_args(flags(application["args"]))
    assert (args.replicas, args.max_batch_size, args.max_queue) == (2, 128, 256)
    assert flags({"no_prefix_caching": True, "cors_origins": ["*"], "api_key": None}) == [
        "--no-prefix-caching", "--cors-origins", "*",
    ]  # fmt: skip
    assert app_builder(application["args"]) is not None


# -- the ingress side of a call --------------------------------------------------------------------------------


class FakeCall:
    """A streaming call's answer as the handle gives it: an async iterator that can be cancelled."""

    def __init__(self, items: list[Any], then: BaseException | None = None) -> None:
        self._items = list(items)
        self._then = then
        self.cancelled = False
        self._wake = asyncio.Event()

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> Any:
        if self._items:
            return self._items.pop(0)
        if self._then is not None:
            raise self._then
        await self._wake.wait()  # a call still running: only a cancel ends it
        raise asyncio.CancelledError

    def cancel(self) -> None:
        self.cancelled = True
        self._wake.set()


class FakeHandle:
    def __init__(self, calls: list[FakeCall]) -> None:
        self.calls = calls
        self.generate = self

    def options(self, stream: bool) -> FakeHandle:
        return self

    def remote(self, submission: Submission) -> FakeCall:
        return self.calls.pop(0)


def submission() -> Submission:
    return Submission(GenerationRequest((1, 2, 3), 4))


async def read(stream: Any) -> list[Delta]:
    return [delta async for delta in stream.deltas()]


def test_a_stream_ends_with_its_last_delta_and_leaves_the_in_flight_set() -> None:
    async def run() -> None:
        backend = RayBackend(
            FakeHandle([FakeCall([Accepted("r1"), Delta("a", [1]), Delta("b", [2], "length")])]), None, 4
        )
        stream = await backend.submit(submission())
        assert stream.replica == "r1" and not backend.is_idle
        assert [d.text for d in await read(stream)] == ["a", "b"]
        assert backend.is_idle

    asyncio.run(run())


def test_full_replicas_and_a_full_handle_queue_are_queue_full() -> None:
    async def run() -> None:
        for call in (
            FakeCall([Rejected("full")]),
            FakeCall([], then=BackPressureError(num_queued_requests=4, max_queued_requests=4)),
        ):
            with pytest.raises(QueueFullError):
                await RayBackend(FakeHandle([call]), None, 4).submit(submission())

    asyncio.run(run())


def test_a_replica_dying_before_it_accepts_is_retried_on_another() -> None:
    async def run() -> None:
        calls = [FakeCall([], then=ActorDiedError()), FakeCall([Accepted("r2"), Delta("x", [1], "stop")])]
        stream = await RayBackend(FakeHandle(calls), None, 4).submit(submission())
        assert stream.replica == "r2"

    asyncio.run(run())


def test_a_replica_dying_or_failing_mid_stream_is_an_engine_error() -> None:
    async def run() -> None:
        for call in (FakeCall([Delta("a", [1])], then=ActorDiedError()), FakeCall([Delta("a", [1]), Failed("boom")])):
            with pytest.raises(EngineError):
                await read(RemoteStream(call, "r1", set()))

    asyncio.run(run())


def test_abort_cancels_the_call_and_fail_all_tells_the_reader_why() -> None:
    async def run() -> None:
        call = FakeCall([Accepted("r1"), Delta("a", [1])])
        backend = RayBackend(FakeHandle([call]), None, 4)
        stream = await backend.submit(submission())
        reader = asyncio.ensure_future(read(stream))
        await asyncio.sleep(0.01)
        backend.fail_all("shutting down")
        with pytest.raises(EngineError, match="shutting down"):
            await reader
        assert call.cancelled and backend.is_idle

        call = FakeCall([Accepted("r1")])
        backend = RayBackend(FakeHandle([call]), None, 4)
        backend.abort(await backend.submit(submission()))
        assert call.cancelled and backend.is_idle

    asyncio.run(run())


def test_the_ingress_knows_whether_an_interactive_sequence_runs_on_any_replica() -> None:
    """Batches yield to interactive requests on a cluster too: the ingress reads its own streams' priorities."""

    async def run() -> None:
        calls = [FakeCall([Accepted("r1")]), FakeCall([Accepted("r2")])]
        backend = RayBackend(FakeHandle(calls), None, 4)
        batch_line = await backend.submit(Submission(GenerationRequest((1, 2), 4, priority=1 << 20)))
        assert not backend.has_priority_below(1 << 20)
        interactive = await backend.submit(submission())
        assert backend.has_priority_below(1 << 20) and not backend.has_priority_below(0)
        backend.abort(interactive)
        assert not backend.has_priority_below(1 << 20)
        backend.abort(batch_line)

    asyncio.run(run())


def test_replica_metrics_are_labelled_by_replica_in_one_family_each() -> None:
    texts = {}
    for name, running in (("r1", 3), ("r2", 5)):
        registry = CollectorRegistry()
        Gauge("smolserve:num_requests_running", "running", registry=registry).set(running)
        Counter("smolserve:prefix_cache_hits", "hits", registry=registry).inc(running * 10)
        texts[name] = generate_latest(registry)
    merged = CollectorRegistry()
    merged.register(_ReplicaCollector(lambda: texts))
    out = generate_latest(merged).decode()
    assert 'smolserve:num_requests_running{replica="r1"} 3.0' in out
    assert 'smolserve:num_requests_running{replica="r2"} 5.0' in out
    assert 'smolserve:prefix_cache_hits_total{replica="r2"} 50.0' in out
    assert out.count("# TYPE smolserve:num_requests_running gauge") == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_the_prompt_cache_key_travels_with_each_sequence(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the cluster's router reads: the body's ``prompt_cache_key`` on every submission (none without it)."""
    seen: list[str | None] = []
    submit = LocalBackend.submit

    async def recording(self: LocalBackend, submission: Submission) -> Any:
        seen.append(submission.cache_key)
        return await submit(self, submission)

    monkeypatch.setattr(LocalBackend, "submit", recording)
    body: dict[str, Any] = {"max_tokens": 2} if path.endswith("completions") else {"max_output_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if path.endswith("completions") else {"input": "hi"}
    with fake_client() as client:
        for extra in ({"prompt_cache_key": "session-1", "n": 2} if "chat" in path else {"prompt_cache_key": "s-1"}, {}):
            assert client.post(path, json=body | extra).status_code == 200
        too_long = client.post(path, json=body | {"prompt_cache_key": "k" * 257})
        assert too_long.status_code == 400 and "prompt_cache_key" in too_long.text
    assert seen == (["session-1", "session-1", None] if "chat" in path else ["s-1", None])
