"""Routing over many replicas, by simulation: prefix affinity (``cluster/routing.py``, the router the cluster runs)
against power-of-two-choices (Ray Serve's default), on a chat workload whose prompts share long prefixes.

    .venv/bin/python bench/sim_routing.py                        # 4, 8, 16 replicas, 600 simulated seconds
    .venv/bin/python bench/sim_routing.py --replicas 8 --seconds 1200 --seed 3

The model (its inputs measured on the 2-core development machine, float32, bench/README.md):

* A replica is one engine doing continuous batching: each step decodes one token for every running sequence
  and prefills up to 256 prompt tokens (FIFO over the sequences still prefilling); it takes 33 ms + 2.2 ms per
  decoding sequence + 2.5 ms per prefilled token (decode steps measured 36 / 56 / 72 / 104 ms at batch 1 / 8 / 16
  / 32; a 255-token prompt took 0.52 s and a 1,000-token one 2.9 s to its first token). At most 128 sequences run.
* Its prefix cache holds 5,800 blocks of 16 tokens (``--kv-cache-gib 4`` of float32 KV for SmolLM2-135M),
  least recently used first out; a newcomer skips the prefill of its longest cached run of leading blocks. A
  finished sequence's prompt and answer blocks stay cached.
* The workload: 48 tenants (agents, apps), each with its own system prompt of 600-1,500 tokens, popular by a
  Zipf law; users of a tenant hold conversations: every turn sends the whole conversation so far (system prompt,
  earlier questions and answers) plus a new question of 20-100 tokens, and gets 32-128 tokens back. Turns arrive
  as a Poisson process, ``--rate`` per replica per second, each from a user picked at random among 120 per replica.
* Routers see what the real one sees: ongoing requests per replica (running + waiting) and the prompts they sent.
  Power-of-two-choices picks two replicas at random and sends to the less loaded one.

Reported per replica count and router: the share of prompt tokens served from a prefix cache, time to first
token p50 / p99, output tokens per second, and the spread of requests over replicas (most / fewest).
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.routing import PrefixAffinity  # noqa: E402
from engine.core.block_pool import prefix_hashes  # noqa: E402

BLOCK = 16
STEP_BASE_S, STEP_PER_DECODE_S, STEP_PER_PREFILL_TOKEN_S = 0.033, 0.0022, 0.0025
PREFILL_BUDGET, MAX_BATCH, CACHE_BLOCKS = 256, 128, 5800
TENANTS, USERS_PER_REPLICA = 48, 120


@dataclass
class Request:
    arrival: float
    prompt: list[int]
    output: list[int]
    hashes: list[bytes] = field(default_factory=list)
    to_prefill: int = 0
    generated: int = 0
    cached: int = 0
    first_token: float | None = None


@dataclass
class Replica:
    name: str
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    busy: bool = False
    served: int = 0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def admit(self) -> None:
        while self.waiting and len(self.running) < MAX_BATCH:
            request = self.waiting.pop(0)
            matched = 0
            for digest in request.hashes:
                if digest not in self.cache:
                    break
                self.cache.move_to_end(digest)
                matched += 1
            request.cached = min(matched * BLOCK, len(request.prompt) - 1)
            request.to_prefill = len(request.prompt) - request.cached
            self.running.append(request)
            self.served += 1

    def step(self, now: float) -> float:
        """Run one step from ``now``; returns its end. Sequences whose prompt completes get their first token then."""
        budget, decoding = PREFILL_BUDGET, 0
        prefilled = 0
        for request in self.running:
            if request.to_prefill == 0:
                decoding += 1
            elif budget:
                take = min(budget, request.to_prefill)
                request.to_prefill -= take
                budget -= take
                prefilled += take
        end = now + STEP_BASE_S + STEP_PER_DECODE_S * decoding + STEP_PER_PREFILL_TOKEN_S * prefilled
        for request in list(self.running):
            if request.to_prefill:
                continue
            if request.first_token is None:
                request.first_token = end
            request.generated += 1
            if request.generated == len(request.output):
                self.running.remove(request)
                self.remember(prefix_hashes(request.prompt + request.output, BLOCK))
        return end

    def remember(self, hashes: list[bytes]) -> None:
        for digest in hashes:
            self.cache[digest] = None
            self.cache.move_to_end(digest)
        while len(self.cache) > CACHE_BLOCKS:
            self.cache.popitem(last=False)


class Workload:
    """Conversations of users of tenants; ``next_turn`` is one user's next request (the whole conversation)."""

    def __init__(self, rng: random.Random, users: int) -> None:
        self.rng = rng
        self._fresh = iter(range(10**6, 10**9))
        self.system = [[next(self._fresh) for _ in range(rng.randint(600, 1500))] for _ in range(TENANTS)]
        weights = [1 / (rank + 1) ** 1.1 for rank in range(TENANTS)]
        tenants = rng.choices(range(TENANTS), weights, k=users)
        self.history = [list(self.system[t]) for t in tenants]

    def next_turn(self, arrival: float) -> Request:
        user = self.rng.randrange(len(self.history))
        question = [next(self._fresh) for _ in range(self.rng.randint(20, 100))]
        prompt = self.history[user] + question
        output = [next(self._fresh) for _ in range(self.rng.randint(32, 128))]
        self.history[user] = prompt + output
        if len(self.history[user]) > 6000:  # a conversation that grew long starts over on its system prompt
            self.history[user] = self.history[user][: len(self.system[0])]
        return Request(arrival, prompt, output, prefix_hashes(prompt, BLOCK))


def power_of_two(rng: random.Random) -> Callable[[Request, list[Replica]], Replica]:
    def route(request: Request, replicas: list[Replica]) -> Replica:
        a, b = rng.sample(replicas, 2)
        return a if a.load <= b.load else b

    return route


def prefix_affinity(rng: random.Random) -> Callable[[Request, list[Replica]], Replica]:
    policy = PrefixAffinity()

    def route(request: Request, replicas: list[Replica]) -> Replica:
        by_name = {r.name: r for r in replicas}
        ranks = policy.choose(request.hashes, {r.name: r.load for r in replicas})
        chosen = by_name[ranks[0][0]]
        policy.record(chosen.name, request.hashes)
        return chosen

    return route


def simulate(num_replicas: int, router: str, seconds: float, rate: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    random.seed(seed)  # the policy breaks ties between equally loaded replicas at random
    workload = Workload(rng, USERS_PER_REPLICA * num_replicas)
    route = {"prefix affinity": prefix_affinity, "power of two": power_of_two}[router](random.Random(seed + 1))
    replicas = [Replica(f"r{i}") for i in range(num_replicas)]
    events: list[tuple[float, int, int]] = []  # (time, kind 0 = arrival / 1 = step end, replica)
    t = 0.0
    while t < seconds:
        t += rng.expovariate(rate * num_replicas)
        heapq.heappush(events, (t, 0, -1))
    done: list[Request] = []
    while events:
        now, kind, index = heapq.heappop(events)
        if kind == 0:
            request = workload.next_turn(now)
            replica = route(request, replicas)
            replica.waiting.append(request)
            done.append(request)
        else:
            replica = replicas[index]
            replica.busy = False
        if not replica.busy and (replica.waiting or replica.running):
            replica.admit()
            replica.busy = True
            heapq.heappush(events, (replica.step(now), 1, replicas.index(replica)))
    first = [r.first_token - r.arrival for r in done if r.first_token is not None]
    makespan = max(r.first_token or 0 for r in done)
    return {
        "hit": sum(r.cached for r in done) / sum(len(r.prompt) for r in done),
        "ttft_p50": statistics.median(first),
        "ttft_p99": sorted(first)[int(0.99 * (len(first) - 1))],
        "tok_s": sum(len(r.output) for r in done) / makespan,
        "spread": max(r.served for r in replicas) / max(min(r.served for r in replicas), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--rate", type=float, default=0.25, help="turns per second per replica")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print("| replicas | router | cache hits | TTFT p50 (s) | TTFT p99 (s) | output tok/s | most / fewest requests |")
    print("|---|---|---|---|---|---|---|")
    for n in args.replicas:
        for router in ("power of two", "prefix affinity"):
            r = simulate(n, router, args.seconds, args.rate, args.seed)
            print(
                f"| {n} | {router} | {r['hit']:.1%} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
                f"{r['tok_s']:.0f} | {r['spread']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
