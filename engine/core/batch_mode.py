"""``--batch-invariant on|off|auto``: one numeric path for every row count, or the fastest path for each step.
Torch-free: the decision over times that ``engine/runtime/path_probe.py`` measures at start-up.

A row's result is the same alone or in any batch only while every step computes it the same way. The quantized
kernel does so at every row count; dense products do so in fixed-shape tiles (``model_runner.DENSE_TILE``). But
the fastest path can change with the rows: on CPUs with AMX, oneDNN's bfloat16 products outrun the quantized
kernel from ~16 rows on (2x at 64), while on AVX2-only CPUs the quantized kernel wins at every row count; and
dense tiles cost their padding and a pass over the weights per tile. So:

- ``on``: one path (the quantized kernel for a model served from its blocks, else dense tiles), whatever it costs;
- ``off``: each step takes the faster path for its rows (quantized below the crossover, dense from it, where dense
  is clearly faster; dense products untiled), and a row's result may change with its batchmates;
- ``auto`` (the default): ``on`` for a model served from its blocks, whatever the probe found: one numerical model
  for every request whatever the load, and no dense copy in memory (the dense twin is ``off``'s, asked for by name;
  with AVX-512 VNNI on AMD Zen 4 the quantized kernel is as fast anyway, on Sapphire Rapids oneDNN's AMX products
  outrun it from ~16 rows: ``describe`` says what invariance costs). A dense model (its invariant path dense tiles)
  is ``on`` when that costs under ``AUTO_MAX_COST`` of the matmuls' best throughput at ``--max-batch-size`` rows,
  else ``off``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: What ``auto`` may give up for invariance: the matmuls' time at the configured batch size, against the best.
AUTO_MAX_COST = 0.05
#: Dense products take over from a row count where they need at most this share of the quantized kernel's time.
#: Near the break-even the probe's times swing from start to start (on Sapphire Rapids at 16 rows dense took
#: 0.80-1.07 of the quantized time; at 32 rows 0.55-0.69), and the crossover decides which numerics a step of
#: those rows gets: without a margin, restarts and a cluster's replicas chose 16 or 32 rows by chance and gave
#: different greedy text for the same request.
CROSSOVER_MARGIN = 0.75


@dataclass(slots=True, frozen=True)
class PathTimes:
    """Seconds of one step's matmuls (every layer's projections and the output layer) at each row count."""

    rows: tuple[int, ...]
    #: The invariant path: the quantized kernel (a model served from its blocks), else dense in fixed tiles.
    invariant: tuple[float, ...]
    #: Dense products, untiled (for a quantized model: its dense copy).
    dense: tuple[float, ...]
    #: Whether the invariant path is the quantized kernel (else dense tiles of the same weights).
    quantized: bool

    def describe(self) -> str:
        pairs = zip(self.rows, self.invariant, self.dense, strict=True)
        times = ", ".join(f"{rows}: {a * 1e3:.1f} / {b * 1e3:.1f}" for rows, a, b in pairs)
        invariant = "quantized" if self.quantized else "dense in tiles"
        return f"matmuls of one step, ms by rows ({invariant} / dense): {times}"

    def at(self, rows: int) -> tuple[float, float]:
        """Both paths' times at the measured row count nearest ``rows`` from above (or the largest)."""
        index = next((i for i, r in enumerate(self.rows) if r >= rows), len(self.rows) - 1)
        return self.invariant[index], self.dense[index]


@dataclass(slots=True, frozen=True)
class BatchMode:
    requested: str
    invariant: bool
    #: A quantized model, not invariant: steps of at least this many rows run dense (None: never).
    dense_from_rows: int | None
    #: What invariance costs at the configured batch size: 0.4 means 40% of the matmuls' best throughput.
    cost: float | None
    batch_size: int

    def describe(self) -> str:
        mode = "on" if self.invariant else "off"
        cost = "unmeasured" if self.cost is None else f"{self.cost:.0%} of the matmuls' speed at {self.batch_size} rows"
        paths = (
            f"dense from {self.dense_from_rows} rows, quantized below" if self.dense_from_rows is not None
            else "one path for every row count"
        )  # fmt: skip
        return f"batch invariance {mode} ({self.requested}; {paths}); invariance costs {cost}"


def crossover(times: PathTimes) -> int | None:
    """The fewest rows from which the dense path is clearly faster (``CROSSOVER_MARGIN``) at every larger measured
    row count; None if never."""
    start = None
    for rows, invariant, dense in zip(times.rows, times.invariant, times.dense, strict=True):
        start = (start or rows) if dense <= CROSSOVER_MARGIN * invariant else None
    return start


def choose(requested: str, times: PathTimes | None, batch_size: int, blocks_only: bool = False) -> BatchMode:
    """The mode for ``--batch-invariant requested``, given the probe's ``times`` (None: nothing to choose between,
    e.g. a model the lean runner does not run, whose products are transformers' own). ``blocks_only``: the lean
    runner multiplies the blocks at every row count (a mixture of experts: no dense twin), invariant unless off."""
    if requested not in ("on", "off", "auto"):
        raise ValueError(f"--batch-invariant must be on, off or auto, not {requested!r}")
    if times is None and blocks_only:
        return BatchMode(requested, requested != "off", None, None, batch_size)
    if times is None:
        if requested == "on":
            raise ValueError("--batch-invariant on needs a llama-architecture model on the CPU (the lean runner)")
        return BatchMode(requested, False, None, None, batch_size)
    invariant, dense = times.at(batch_size)
    cost = max(0.0, 1 - min(invariant, dense) / invariant)
    on = requested == "on" or (requested == "auto" and (times.quantized or cost < AUTO_MAX_COST))
    dense_from = None if on or not times.quantized else crossover(times)
    return BatchMode(requested, on, dense_from, cost, batch_size)


#: One path for every row count, chosen without a probe: what an engine built directly (tests, benchmarks) runs.
INVARIANT = BatchMode("on", True, None, None, 0)
