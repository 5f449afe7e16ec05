"""``--batch-invariant``: the choice between one path for every row count and the fastest path per step, on the
times a probe would measure on each CPU class (written here, so every machine checks every class's decision)."""

from __future__ import annotations

import pytest

from engine.core.batch_mode import AUTO_MAX_COST, PathTimes, choose, crossover

ROWS = (1, 8, 16, 32, 64, 128)
# Matmul seconds per step, as measured on the project's machines (bench/README.md, "Batch invariance").
AVX2 = PathTimes(ROWS, (0.004, 0.012, 0.02, 0.035, 0.06, 0.11), (0.022, 0.03, 0.045, 0.07, 0.12, 0.2), True)
AMX = PathTimes(ROWS, (0.0024, 0.0083, 0.0162, 0.0325, 0.062, 0.128), (0.0087, 0.0087, 0.009, 0.0097, 0.0123, 0.0184),
                True)  # fmt: skip
DENSE_TILES = PathTimes(ROWS, (0.008, 0.008, 0.009, 0.019, 0.036, 0.072), (0.0087, 0.0087, 0.009, 0.0097, 0.0123,
                        0.0184), False)  # fmt: skip


def test_auto_keeps_one_path_where_it_is_the_fastest_anyway() -> None:
    mode = choose("auto", AVX2, 128)
    assert mode.invariant and mode.dense_from_rows is None and mode.cost == 0
    assert "batch invariance on (auto; one path for every row count)" in mode.describe()


def test_auto_keeps_one_path_for_a_gguf_s_blocks_even_where_dense_would_be_faster() -> None:
    """Sapphire Rapids: oneDNN's AMX products outrun the quantized kernel from 16 rows. The default still keeps one
    numerical path (an evaluation's score must not depend on the load) and makes no dense copy; it says what that
    costs, and ``off`` takes dense from the crossover."""
    mode = choose("auto", AMX, 128)
    assert mode.invariant and mode.dense_from_rows is None
    assert mode.cost == pytest.approx(1 - 0.0184 / 0.128)
    assert "batch invariance on (auto; one path for every row count); invariance costs 86%" in mode.describe()
    off = choose("off", AMX, 128)
    assert not off.invariant and off.dense_from_rows == 16
    assert "dense from 16 rows, quantized below" in off.describe()


# AMD Zen 4 (AVX-512 with VNNI, no AMX), the Qwen2.5-Coder file, 2026-12-05: dense bfloat16 a little faster from 32
# rows, never by the crossover's margin.
ZEN4 = PathTimes(ROWS, (0.0194, 0.0319, 0.059, 0.1005, 0.2074, 0.4113), (0.0443, 0.0464, 0.0652, 0.0924, 0.163,
                 0.3122), True)  # fmt: skip


def test_auto_keeps_one_path_where_the_dense_copy_is_nowhere_clearly_faster() -> None:
    """Without a crossover `off` would run the quantized kernel at every row count too: `auto` says so (on), and
    no dense copy is made, whatever the probe's cost figure at the batch size."""
    mode = choose("auto", ZEN4, 128)
    assert mode.invariant and mode.dense_from_rows is None and mode.cost > AUTO_MAX_COST
    assert "batch invariance on (auto; one path for every row count)" in mode.describe()
    assert not choose("auto", DENSE_TILES, 128).invariant  # dense tiles against untiled dense: a real choice


def test_on_and_off_are_obeyed_whatever_they_cost() -> None:
    on = choose("on", AMX, 128)
    assert on.invariant and on.dense_from_rows is None and on.cost > AUTO_MAX_COST
    off = choose("off", AVX2, 128)
    assert not off.invariant and off.dense_from_rows is None  # no crossover: the quantized kernel serves all rows


def test_a_dense_model_chooses_between_tiles_and_untiled_products() -> None:
    mode = choose("auto", DENSE_TILES, 128)
    assert not mode.invariant and mode.dense_from_rows is None
    assert choose("on", DENSE_TILES, 128).invariant


def test_the_crossover_is_where_dense_wins_from_then_on() -> None:
    bumpy = PathTimes(ROWS, (1, 2, 3, 4, 5, 6), (0.5, 3, 2, 5, 3, 4), True)
    assert crossover(bumpy) == 64  # dense won at 1 and 16 rows too, but not at every larger count
    assert crossover(AVX2) is None


@pytest.mark.parametrize(
    "at_16",
    [0.0195 / 0.0155, 0.0198 / 0.0177, 0.0199 / 0.0186, 0.0216 / 0.0172, 0.0229 / 0.0246],
    ids=["1.26x", "1.12x", "1.07x", "1.26x", "0.93x"],
)
def test_the_crossover_stays_put_where_the_paths_are_close(at_16: float) -> None:
    """Sapphire Rapids' probes at 16 rows, five starts (quantized time / dense): near the break-even, where the
    choice went by chance; with the margin every start takes dense from 32 rows, where it is clearly faster."""
    rows = (1, 8, 16, 32, 64, 128)
    quantized = (0.0065, 0.0122, 0.020, 0.040, 0.084, 0.154)
    dense = (0.0162, 0.0175, 0.020 / at_16, 0.028, 0.0307, 0.0442)
    assert crossover(PathTimes(rows, quantized, dense, True)) == 32


def test_a_model_without_a_choice_cannot_be_made_invariant() -> None:
    assert not choose("auto", None, 128).invariant
    with pytest.raises(ValueError, match="--batch-invariant on needs"):
        choose("on", None, 128)
    with pytest.raises(ValueError, match="on, off or auto"):
        choose("sometimes", AVX2, 128)
