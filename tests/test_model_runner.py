"""The lean runner's building blocks: matmuls whose rows do not depend on each other, and a forward that may
sample no row at all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model_runner import linear, prepack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_matmul_works_in_every_dtype_this_cpu_has(dtype: torch.dtype) -> None:
    """oneDNN packs bfloat16 only with AVX-512 (or AVX-NE-CONVERT); elsewhere the weight stays plain, where
    before `--dtype bfloat16` failed at start-up."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64).to(dtype), torch.randn(5, 64).to(dtype)
    got = linear(x, prepack(weight))
    torch.testing.assert_close(got.float(), F.linear(x, weight).float(), atol=0.05, rtol=0.02)


def test_each_rows_product_is_the_same_for_any_number_of_rows(served_model) -> None:
    """Batch invariance rests on it: a row's matmul result does not depend on how many rows share the call or
    where it sits among them. Checked on the served model's own packed weights, in its own dtype."""
    from engine.model_runner import LlamaRunner

    runner = LlamaRunner(served_model.model, 64)
    layer = runner.layers[0]
    torch.manual_seed(0)
    for weight in (layer.qkv, layer.o, layer.gate_up, layer.down, runner.lm_head):
        config = served_model.model.config
        width = config.intermediate_size if weight is runner.layers[0].down else config.hidden_size
        rows = torch.randn(300, width).to(served_model.model.dtype)
        alone = linear(rows[:1], weight)
        for count in (2, 3, 16, 17, 31, 64, 255, 300):
            assert torch.equal(linear(rows[:count], weight)[:1], alone), f"{count} rows"
        assert torch.equal(linear(torch.cat([rows[5:9], rows[:1]]), weight)[4:], alone)
