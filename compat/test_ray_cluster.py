"""The server as engine replicas on Ray Serve (``python -m app --replicas N``), on a local Ray instance bound to
127.0.0.1: the official client gets the one-process server's answers; load spreads; a shared prefix stays on one
replica; a client leaving frees its sequence; a killed replica's requests end cleanly and Serve brings it back;
full queues are a 429; SIGTERM drains and exits 0. The clusters start once per module (their start-up is paid
once): one with two replicas, one with tiny queues."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from compat.conftest import FACTS, MODEL, start_server, stop_server

pytestmark = pytest.mark.real_model

REPLICA_PROCESS = "ray::ServeReplica:smolserve:EngineReplica"
PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["city", "country"],
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Batch-invariant, as the one process it is compared with: their batches differ.
    data = tmp_path_factory.mktemp("cluster-data")  # the Batch API's files
    # Ten minutes to start: a fresh machine's first replicas may build the native kernels, one after another.
    proc, base = start_server("--model", MODEL, "--replicas", "2", "--batch-invariant", "on", "--data-dir", str(data),
                              startup_timeout=600)  # fmt: skip
    try:
        wait_for(lambda: live_replicas(base) == 2, 120)
        yield base
    finally:
        stop_server(proc)


def live_replicas(base: str) -> int:
    return httpx.get(f"{base}/health", timeout=5).json()["replicas"]["live"]


def wait_for(condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.25)
    raise AssertionError("timed out waiting")


def replica_series(base: str, name: str) -> dict[str, float]:
    """``smolserve:<name>`` by replica, from the cluster's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    pattern = re.compile(rf'^smolserve:{name}\{{replica="([^"]+)"\}} (\S+)$', re.M)
    return {replica: float(value) for replica, value in pattern.findall(text)}


def growth(base: str, name: str, before: dict[str, float]) -> dict[str, float]:
    return {replica: value - before.get(replica, 0) for replica, value in replica_series(base, name).items()}


def client_for(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


# -- the same answers as one process ------------------------------------------------------------------------


def answers(base: str) -> list[object]:
    """Greedy completions and chats, plain and streamed, with n, stop strings and logprobs."""
    with client_for(base) as client:
        out: list[object] = []
        done = client.completions.create(
            model=MODEL, prompt=["The capital of France is", "def fib(n):"], max_tokens=12, temperature=0, logprobs=2
        )
        out += [(c.text, c.finish_reason, [round(x, 2) for x in c.logprobs.token_logprobs]) for c in done.choices]
        out.append((done.usage.prompt_tokens, done.usage.completion_tokens))  # cached tokens: what each has seen
        stopped = client.completions.create(
            model=MODEL, prompt="Count: one, two, three,", max_tokens=30, temperature=0, stop=[" five"]
        )
        out.append((stopped.choices[0].text, stopped.choices[0].finish_reason))
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=16, temperature=0, n=2
        )
        out += [(c.message.content, c.finish_reason) for c in chat.choices]
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        out.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        out.append(chunks[-1].usage.completion_tokens)
        structured = client.chat.completions.create(  # a grammar, compiled again where the sequence runs
            model=MODEL,
            messages=[{"role": "user", "content": "Give a city and its country as JSON."}],
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}},
        )
        out.append(structured.choices[0].message.content)
        # The Responses API: its store lives with the HTTP layer, so a conversation continues whichever replica ran
        # the turn before.
        first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=12, temperature=0)
        second = client.responses.create(
            model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=12, temperature=0
        )
        out += [first.output_text, second.output_text, second.usage.input_tokens]
        out.append(client.responses.retrieve(second.id).output_text)
        return out


def test_the_cluster_answers_as_one_process(cluster: str, invariant_server_url: str) -> None:
    assert answers(cluster) == answers(invariant_server_url)


# -- routing --------------------------------------------------------------------------------------------------


def test_concurrent_requests_spread_over_both_replicas(cluster: str) -> None:
    before = replica_series(cluster, "prefix_cache_queries_total")

    def one(i: int) -> int:
        body = {"model": MODEL, "prompt": f"Request {i}: tell me about {FACTS[i % 5]}", "max_tokens": 24}
        return httpx.post(f"{cluster}/v1/completions", json=body, timeout=120).status_code

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [200] * 16
    time.sleep(2.5)  # replicas report their metrics every second
    after = replica_series(cluster, "prefix_cache_queries_total")
    assert len(after) == 2
    assert all(after[r] > before.get(r, 0) for r in after), (before, after)


def test_a_batch_runs_across_both_replicas(cluster: str) -> None:
    """The Batch API on a cluster: the ingress keeps the files and sends each line through its own app, so lines
    spread over the replicas as any requests do, and each answers as the same request sent alone."""
    prompts = [f"Batch line {i}: tell me about {FACTS[i % 5]}" for i in range(24)]
    raw = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                              "body": {"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0}}) + "\n"
                  for i, p in enumerate(prompts))  # fmt: skip
    before = replica_series(cluster, "prefix_cache_queries_total")
    with client_for(cluster) as client:
        upload = client.files.create(file=("lines.jsonl", raw.encode()), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 180)
        done = client.batches.retrieve(batch.id)
        output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        alone = client.completions.create(model=MODEL, prompt=prompts[3], max_tokens=8, temperature=0)
    assert done.request_counts.completed == 24 and [line["custom_id"] for line in output] == [
        f"l{i}" for i in range(24)
    ]
    assert output[3]["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    time.sleep(2.5)  # replicas report their metrics every second
    grown = growth(cluster, "prefix_cache_queries_total", before)
    assert len(grown) == 2 and all(queried > 0 for queried in grown.values()), grown


def test_a_shared_prefix_stays_on_the_replica_that_holds_it(cluster: str) -> None:
    preamble = " ".join(FACTS * 12)  # ~1,000 tokens
    before_queries = replica_series(cluster, "prefix_cache_queries_total")
    before_hits = replica_series(cluster, "prefix_cache_hits_total")
    cached = []
    with client_for(cluster) as client:
        for i in range(6):
            prompt = f"{preamble}\nQuestion {i}: which fact is the strangest?"
            done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            cached.append(done.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] < 900 and all(c >= 992 for c in cached[1:]), cached
    time.sleep(2.5)
    queried = growth(cluster, "prefix_cache_queries_total", before_queries)
    hits = growth(cluster, "prefix_cache_hits_total", before_hits)
    assert sorted(1 if q > 0 else 0 for q in queried.values()) == [0, 1], queried  # one replica saw them all
    assert max(hits.values()) >= 5 * 992


# -- clients leaving, replicas dying ------------------------------------------------------------------------


def test_a_client_leaving_mid_stream_frees_its_sequence(cluster: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]
        wait_for(lambda: sum(replica_series(cluster, "num_requests_running").values()) == 1, 10)
    wait_for(lambda: sum(replica_series(cluster, "num_requests_running").values()) == 0, 10)


def read_stream(base: str, prompt: str, events: list[str], started: threading.Event, max_tokens: int = 400) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def test_a_killed_replica_ends_its_streams_cleanly_and_comes_back(cluster: str) -> None:
    streams = [([], threading.Event()) for _ in range(4)]
    readers = [
        threading.Thread(target=read_stream, args=(cluster, f"Story {i}: {FACTS[i]}", events, started, 1500))
        for i, (events, started) in enumerate(streams)
    ]
    # One after another, each streaming before the next is sent: the router then sees the loads it balances (four
    # simultaneous arrivals could all meet stale loads of 0 and land on one replica, which leaves nothing to tell).
    for reader, (_, started) in zip(readers, streams, strict=True):
        reader.start()
        assert started.wait(60)
    wait_for(lambda: sorted(n > 0 for n in replica_series(cluster, "num_requests_running").values()) == [True] * 2, 10)
    victim = int(subprocess.run(["pgrep", "-f", REPLICA_PROCESS], capture_output=True, text=True).stdout.split()[0])
    os.kill(victim, signal.SIGKILL)
    with client_for(cluster) as client:  # meanwhile, new requests go to the live replica
        assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0].text
    for reader in readers:
        reader.join(timeout=120)
        assert not reader.is_alive()
    outcomes = []
    for events, _ in streams:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        outcomes.append("error" if "error" in last else last["choices"][0]["finish_reason"])
    assert sorted(set(outcomes)) == ["error", "length"], outcomes
    wait_for(lambda: live_replicas(cluster) == 2, 120)  # Serve restarted it


# -- full queues, SIGTERM ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cluster() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    proc, base = start_server("--model", MODEL, "--replicas", "2", "--max-batch-size", "1", "--max-queue", "1")
    try:
        wait_for(lambda: live_replicas(base) == 2, 120)
        yield proc, base
    finally:
        stop_server(proc)


def test_full_queues_answer_429_with_retry_after(small_cluster: tuple[subprocess.Popen[bytes], str]) -> None:
    _, base = small_cluster

    def one(i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"Story {i}", "max_tokens": 64, "ignore_eos": True}
        return httpx.post(f"{base}/v1/completions", json=body, timeout=120)

    # The cluster holds 4 at once (2 replicas x (batch 1 + queue 1)). Those 4 arrive a little apart: Ray's handle
    # may refuse simultaneous arrivals while an earlier one is still being routed (its documented over-rejection).
    with ThreadPoolExecutor(12) as pool:
        held = []
        for i in range(4):
            held.append(pool.submit(one, i))
            time.sleep(0.3)
        burst = list(pool.map(one, range(4, 12)))
    held_codes, burst_codes = [f.result().status_code for f in held], sorted(r.status_code for r in burst)
    assert held_codes == [200] * 4, held_codes
    assert burst_codes.count(429) >= 1 and set(burst_codes) <= {200, 429}, burst_codes
    rejected = next(r for r in burst if r.status_code == 429)
    assert rejected.headers["retry-after"] == "1"
    assert rejected.json()["error"]["code"] == "queue_full"


def test_sigterm_drains_the_cluster_and_exits_0(small_cluster: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, base = small_cluster
    events: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=read_stream, args=(base, "Once upon a time", events, started))
    reader.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    newcomer = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=30)
    assert newcomer.status_code == 503
    reader.join(timeout=120)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0
