"""Block-based KV memory through the official client against the default server (default flags): open-ended
streams are admitted by what they hold, and a shared prefix is reported as cached in `usage`."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
from openai import AsyncOpenAI, OpenAI

from compat.conftest import FACTS, MODEL, start_server, stop_server


def preamble(tokens_at_least: int, client: OpenAI) -> str:
    """A system prompt of at least ``tokens_at_least`` tokens, unique to this call (so no earlier request of the
    session cached it)."""
    text = f"Session {uuid.uuid4().hex}. You answer questions using only these facts.\n"
    while True:
        text += " ".join(FACTS) + "\n"
        counted = client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": text}], max_tokens=1
        ).usage.prompt_tokens
        if counted >= tokens_at_least:
            return text


def test_the_second_request_sharing_a_long_prefix_reports_it_cached(client: OpenAI) -> None:
    system = preamble(1000, client)
    questions = ["Which river flows north?", "How many hearts does an octopus have?"]
    usages = []
    for question in questions:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        usages.append(reply.usage)
    # The first of these two already finds the preamble cached (preamble() sent it while measuring); the second
    # shares the template's header, the whole preamble and the user turn's opening with it.
    assert usages[1].prompt_tokens >= 1000
    assert usages[1].prompt_tokens_details is not None
    assert usages[1].prompt_tokens_details.cached_tokens >= 992
    assert usages[1].prompt_tokens_details.cached_tokens < usages[1].prompt_tokens


def test_32_open_ended_chat_streams_all_run_at_once(server_url: str) -> None:
    """No max_tokens: each may run to the whole context, yet all 32 are admitted together under the default
    KV memory (observed through /metrics), since each holds only what it has so far."""

    def gauge(name: str) -> float:
        text = httpx.get(f"{server_url}/metrics", timeout=10).text
        return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(f"smolserve:{name} "))

    async def run() -> float:
        async with AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            streams = [
                await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Tell me a long story about the number {i}."}],
                    stream=True,
                )
                for i in range(32)
            ]
            firsts = [asyncio.ensure_future(stream.__anext__()) for stream in streams]
            await asyncio.gather(*firsts)  # every stream has started
            most = 0.0
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and most < 32:
                most = max(most, await asyncio.to_thread(gauge, "num_requests_running"))
                await asyncio.sleep(0.2)
            for stream in streams:
                await stream.close()  # the clients leave; their sequences leave the batch
            return most

    assert asyncio.run(run()) == 32
    deadline = time.monotonic() + 60
    # The running count drops when a client leaves; its blocks are freed at the engine's next step boundary.
    while (gauge("num_requests_running") or gauge("kv_blocks_in_use")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gauge("num_requests_running") == 0
    assert gauge("kv_blocks_in_use") == 0


def test_an_agent_s_prefix_survives_a_kill_and_a_restart(tmp_path: Path) -> None:
    """The server is killed (-9) with a long prompt's blocks written or being written, and a torn file left; the
    next one over the same ``--data-dir`` removes the torn file, takes the prefix from disk (usage's cached tokens,
    the disk-hit counter) and answers with the first server's tokens and logprobs."""
    data, system = tmp_path / "data", f"You answer from these facts.\n{' '.join(FACTS * 6)}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which river flows north?"}]
    answers = []
    for run in range(2):
        proc, base = start_server("--model", MODEL, "--data-dir", str(data))
        try:
            client = OpenAI(base_url=f"{base}/v1", api_key="unused")
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=2)  # type: ignore[arg-type]  # fmt: skip
            answers.append(reply)
            if run == 0:
                _wait_for_writes(base, reply.usage.prompt_tokens // 16 - 1)  # type: ignore[union-attr]
                torn = next(data.rglob("*.kv")).with_suffix(".tmp")
                torn.write_bytes(b"SMOLKV01 cut short")
            else:
                assert not torn.exists()
                metrics = httpx.get(f"{base}/metrics").text
                hits = [line for line in metrics.splitlines() if line.startswith("smolserve:prefix_cache_disk_hits")]
                assert float(hits[0].split()[-1]) > 0, hits
        finally:
            if run == 0:
                proc.kill()  # -9: the writer gets no time to finish
                proc.wait()
            else:
                stop_server(proc)
    first, second = answers
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32  # type: ignore[union-attr]
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.choices[0].logprobs == first.choices[0].logprobs


def _wait_for_writes(base: str, blocks: int, timeout: float = 30) -> None:
    """Until the disk tier holds ``blocks`` blocks (``/health``'s ``kv_disk``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/health").json()["engine"]["kv_disk"]["blocks"] >= blocks:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {blocks} blocks on disk after {timeout} s")
