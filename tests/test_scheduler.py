"""The scheduler over FakeEngine: joining, independent resolution, capacity, admission errors, engine faults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from engine.core.fake_engine import FakeEngine
from engine.core.scheduler import QueueFullError, Scheduler
from engine.core.streams import Delta, EngineError, RequestStream
from engine.core.tokenizer import ByteTokenizer
from engine.core.types import GenerationRequest, StepOutput


class RecordingEngine(FakeEngine):
    """Records the active count at every step, to prove capacity is never exceeded."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.active_per_step: list[int] = []

    def step(self) -> list[StepOutput]:
        self.active_per_step.append(self.num_active())
        return super().step()


def req(max_new: int = 4, prompt: str = "hi") -> GenerationRequest:
    return GenerationRequest(tuple(prompt.encode()), max_new)


async def collect(stream: RequestStream) -> list[Delta]:
    return [d async for d in stream.deltas()]


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def run(engine: FakeEngine, body: Callable[[Scheduler], Awaitable[None]], **kwargs: int) -> None:
    async def main() -> None:
        scheduler = Scheduler(engine, ByteTokenizer(), **kwargs)
        await scheduler.start()
        try:
            await asyncio.wait_for(body(scheduler), timeout=10)
        finally:
            await scheduler.stop()

    asyncio.run(main())


def test_each_request_gets_its_own_tokens_and_finish() -> None:
    async def body(s: Scheduler) -> None:
        deltas = await asyncio.gather(collect(s.submit(req(3))), collect(s.submit(req(7))))
        assert [text_of(d) for d in deltas] == ["abc", "abcdefg"]
        assert [d[-1].finish_reason for d in deltas] == ["length", "length"]
        assert all(x.finish_reason is None for d in deltas for x in d[:-1])

    run(FakeEngine(), body)


def test_short_request_resolves_before_its_long_batchmate() -> None:
    async def body(s: Scheduler) -> None:
        long = asyncio.create_task(collect(s.submit(req(50))))
        short = await collect(s.submit(req(2)))
        assert text_of(short) == "ab"
        assert not long.done()  # resolved independently, while the long one still runs
        assert len(await long) == 50

    run(FakeEngine(), body)


def test_newcomer_joins_a_running_batch() -> None:
    engine = RecordingEngine()

    async def body(s: Scheduler) -> None:
        first = s.submit(req(30))
        it = first.deltas()
        for _ in range(5):  # the first request is well under way
            await anext(it)
        late = await collect(s.submit(req(3)))
        assert text_of(late) == "abc"
        assert s.num_running == 1  # the first is still going: the newcomer joined it mid-flight
        assert len([d async for d in it]) == 25

    run(engine, body)
    assert 2 in engine.active_per_step


def test_capacity_is_never_exceeded_and_the_queue_drains() -> None:
    engine = RecordingEngine(capacity=3)

    async def body(s: Scheduler) -> None:
        results = await asyncio.gather(*(collect(s.submit(req(2 + i % 5))) for i in range(20)))
        assert [len(r) for r in results] == [2 + i % 5 for i in range(20)]

    run(engine, body)
    assert max(engine.active_per_step) == 3


def test_rejected_admission_fails_only_that_request() -> None:
    async def body(s: Scheduler) -> None:
        good = s.submit(req(4))
        bad = s.submit(GenerationRequest((), 4))  # an empty prompt: admit raises, atomically
        also_good = s.submit(req(2))
        with pytest.raises(EngineError, match="empty"):
            await collect(bad)
        assert text_of(await collect(good)) == "abcd"
        assert text_of(await collect(also_good)) == "ab"

    run(FakeEngine(), body)


def test_engine_fault_fails_its_batch_resets_and_serves_later_requests() -> None:
    engine = FakeEngine()
    engine.fail_on_step = 3

    async def body(s: Scheduler) -> None:
        batch = [s.submit(req(10)), s.submit(req(10))]
        for stream in batch:
            with pytest.raises(EngineError, match="injected engine fault"):
                await collect(stream)
        assert engine.num_active() == 0  # reset
        assert text_of(await collect(s.submit(req(3)))) == "abc"

    run(engine, body)


def test_abort_leaves_the_batch_at_the_next_step() -> None:
    engine = FakeEngine()

    async def body(s: Scheduler) -> None:
        stream = s.submit(req(200))
        it: AsyncIterator[Delta] = stream.deltas()
        await anext(it)
        s.abort(stream)
        other = await collect(s.submit(req(3)))  # a step runs after the abort
        assert text_of(other) == "abc"
        assert engine.num_active() == 0
        assert s.num_running == 0

    run(engine, body)


def test_abort_of_a_waiting_request_drops_it_before_admission() -> None:
    engine = RecordingEngine(capacity=1)

    async def body(s: Scheduler) -> None:
        running = s.submit(req(5))
        waiting = s.submit(req(5))
        s.abort(waiting)
        assert s.num_waiting == 1  # only the first is left to admit
        assert len(await collect(running)) == 5

    run(engine, body)
    assert max(engine.active_per_step) == 1


def test_full_queue_raises() -> None:
    async def body(s: Scheduler) -> None:
        s.submit(req(3))
        s.submit(req(3))
        with pytest.raises(QueueFullError):
            s.submit(req(3))

    run(FakeEngine(), body, max_queue=2)


class BudgetEngine(FakeEngine):
    """Like HFEngine, refuses (for now) what does not fit its KV budget, even when nothing else runs."""

    def can_admit(self, request: GenerationRequest) -> bool:
        return super().can_admit(request) and len(request.prompt_ids) + request.max_new_tokens <= self.max_model_len


def test_a_request_that_can_never_fit_is_rejected_not_queued_forever() -> None:
    async def body(s: Scheduler) -> None:
        too_big = s.submit(req(300))  # over max_model_len 256
        after = s.submit(req(2))
        with pytest.raises(EngineError, match="maximum context length"):
            await collect(too_big)
        assert text_of(await collect(after)) == "ab"

    run(BudgetEngine(), body)


def test_stop_string_cuts_the_text_and_the_sequence_leaves_the_engine() -> None:
    engine = FakeEngine()

    async def body(s: Scheduler) -> None:
        deltas = await collect(s.submit(req(20), stop=("de", "zz")))
        assert text_of(deltas) == "abc"
        assert deltas[-1].finish_reason == "stop"
        kept = await collect(s.submit(req(20), stop=("de",), include_stop=True))
        assert text_of(kept) == "abcde"
        for _ in range(100):  # the abort lands at the next step boundary
            if not engine.num_active():
                break
            await asyncio.sleep(0.01)
        assert engine.num_active() == 0
        assert engine.num_tokens < 40  # neither ran on to its budget of 20

    run(engine, body)


class ReleasingEngine(FakeEngine):
    """Records each time the scheduler asks it to release idle memory, with how many sequences it held."""

    def __init__(self, **kwargs: float) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.releases: list[int] = []

    def release_idle_memory(self) -> None:
        self.releases.append(self.num_active())


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.02)


def test_idle_memory_is_released_once_per_idle_period_and_never_while_running() -> None:
    engine = ReleasingEngine(step_delay=0.05)

    async def body(s: Scheduler) -> None:
        deltas = await collect(s.submit(req(20)))  # ~1 s of steps, past the idle threshold
        assert len(deltas) == 20 and engine.releases == []
        await until(lambda: engine.releases == [0])
        await asyncio.sleep(0.8)
        assert engine.releases == [0]  # once per idle period, not every threshold
        await collect(s.submit(req(2)))
        await until(lambda: engine.releases == [0, 0])

    run(engine, body, idle_release_s=0.3)


def test_a_failing_release_leaves_the_scheduler_serving() -> None:
    class Failing(FakeEngine):
        def release_idle_memory(self) -> None:
            raise RuntimeError("boom")

    async def body(s: Scheduler) -> None:
        await collect(s.submit(req(2)))
        await asyncio.sleep(0.2)  # the release has failed by now
        assert text_of(await collect(s.submit(req(3)))) == "abc"

    run(Failing(), body, idle_release_s=0.05)


class AdmissionEngine(FakeEngine):
    """Records the prompts in the order they are admitted."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.admitted: list[bytes] = []

    def admit(self, requests: list[GenerationRequest]) -> list[int]:
        self.admitted += [bytes(r.prompt_ids) for r in requests]
        return super().admit(requests)


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    """vLLM's ``priority``: with the one slot busy, the waiting queue admits lower values first, FIFO within a
    value; the running sequence (0) is parked for the one more urgent (-1) alone and resumes before the other 0s."""
    import dataclasses

    engine = AdmissionEngine(capacity=1)

    async def body(s: Scheduler) -> None:
        running = s.submit(req(20, "run"))
        await asyncio.sleep(0.01)
        order = [("b5", 5), ("c0", 0), ("d-1", -1), ("e0", 0), ("f5", 5)]
        streams = [s.submit(dataclasses.replace(req(2, name), priority=p)) for name, p in order]
        await asyncio.gather(collect(running), *(collect(stream) for stream in streams))
        assert engine.admitted == [b"run", b"d-1", b"c0", b"e0", b"b5", b"f5"]

    run(engine, body)


def test_a_more_urgent_request_parks_a_running_one_which_resumes_where_it_stopped() -> None:
    """Both slots held by low-priority sequences (a batch's lines): an urgent request is admitted at once, parking
    the newest of them, and finishes while they run; the parked one resumes with no letter repeated or lost."""
    import dataclasses

    engine = FakeEngine(capacity=2, step_delay=0.002)
    finished: list[str] = []

    async def body(s: Scheduler) -> None:
        async def named(name: str, stream: RequestStream) -> str:
            text = text_of(await collect(stream))
            finished.append(name)
            return text

        low = [asyncio.ensure_future(named(f"low{i}", s.submit(dataclasses.replace(req(60), priority=100))))
               for i in range(2)]  # fmt: skip
        await asyncio.sleep(0.03)
        urgent = await named("urgent", s.submit(req(5)))
        assert urgent == "abcde" and finished == ["urgent"]
        expected = "".join(chr(ord("a") + i % 26) for i in range(60))
        assert await asyncio.gather(*low) == [expected, expected]

    run(engine, body)
    assert engine.planner.num_preemptions >= 1
