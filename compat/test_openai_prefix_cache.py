"""Block-based KV memory through the official client against the default server (default flags): open-ended
streams are admitted by what they hold, and a shared prefix is reported as cached in `usage`."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
from openai import AsyncOpenAI, OpenAI

from compat.conftest import FACTS, MODEL


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
