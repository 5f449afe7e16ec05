"""The lean runner's building blocks: matmuls whose rows do not depend on each other, and a forward that may
sample no row at all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runtime.model_runner import DENSE_TILE, linear, prepack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_matmul_works_in_every_dtype_this_cpu_has(dtype: torch.dtype) -> None:
    """oneDNN packs bfloat16 only with AVX-512 (or AVX-NE-CONVERT); elsewhere the weight stays plain, where
    before `--dtype bfloat16` failed at start-up."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64).to(dtype), torch.randn(5, 64).to(dtype)
    got = linear(x, prepack(weight))
    torch.testing.assert_close(got.float(), F.linear(x, weight).float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_rows_product_is_the_same_for_any_number_of_rows(served_model, threads: int) -> None:
    """Batch invariance rests on it: a row's matmul result does not depend on how many rows share the call, where
    it sits among them, or how many threads the team runs (the governor resizes it between steps). Checked on the
    served model's own dense weights, packed, in the default dtype, as the invariant runner multiplies them (in
    tiles of DENSE_TILE rows): before the tiles, oneDNN's AMX bfloat16 kernel changed row 0 at 33+ rows."""
    from engine.runtime.model_runner import LlamaRunner

    runner = LlamaRunner(served_model.model, 64)
    assert runner.tile == DENSE_TILE
    layer = runner.layers[0]
    torch.manual_seed(0)
    before = torch.get_num_threads()
    try:
        for weight in (layer.qkv, layer.o, layer.gate_up, layer.down, runner.lm_head):
            config = served_model.model.config
            width = config.intermediate_size if weight is runner.layers[0].down else config.hidden_size
            rows = torch.randn(300, width).to(served_model.model.dtype)
            torch.set_num_threads(2)
            alone = linear(rows[:1], weight, runner.tile)
            torch.set_num_threads(threads)
            for count in (2, 3, 16, 17, 31, 33, 64, 255, 300):
                assert torch.equal(linear(rows[:count], weight, runner.tile)[:1], alone), f"{count} rows"
            assert torch.equal(linear(torch.cat([rows[5:9], rows[:1]]), weight, runner.tile)[4:], alone)
    finally:
        torch.set_num_threads(before)
