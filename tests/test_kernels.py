"""The native ops against the torch code they replace, and the switch that turns them off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.kv_cache import KEY_TILE, tile_keys
from engine.model_runner import _add_norm, _rope, _silu_mul


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each sequence alone through scaled_dot_product_attention, in float32."""
    rows = [
        F.scaled_dot_product_attention(
            query[i : i + 1].float(), keys[i : i + 1, :, :length].float(), values[i : i + 1, :, :length].float()
        )[0]
        for i, length in enumerate(lengths)
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Query heads per KV head past what one pass holds in registers (4 at dim 64, 2 at 128), and a head size the
# kernel has no specialization for.
@pytest.mark.parametrize(("kv_heads", "groups", "dim"), [(3, 3, 64), (1, 6, 64), (2, 1, 128), (1, 3, 128), (1, 4, 24)])
def test_kernel_matches_torch_attention(dtype: torch.dtype, kv_heads: int, groups: int, dim: int) -> None:
    native = kernels.decode_attention()
    assert native is not None, "the kernel should build wherever the test suite runs (it has a C++ compiler)"
    torch.manual_seed(0)
    # One position, either side of a 16-position tile and of a 64-position block of scores, odd and even.
    lengths = [1, 15, 16, 17, 63, 64, 65, 200]
    # Slot views as the cache holds them: more slots and positions than in use, so rows are strided.
    cache = torch.randn(2, len(lengths) + 2, kv_heads, 256, dim, dtype=dtype)
    query = torch.randn(len(lengths), kv_heads, groups, dim, dtype=dtype)
    keys, values = cache[0, : len(lengths)], cache[1, : len(lengths)]
    out = native(query, tile_keys(keys), values, torch.tensor(lengths), dim**-0.5)
    assert out.dtype == dtype and out.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), _reference(query, keys, values, lengths), atol=tolerance, rtol=tolerance)


def test_kernel_rejects_lengths_beyond_the_cache() -> None:
    native = kernels.decode_attention()
    assert native is not None
    cache = torch.zeros(2, 1, 1, 16, 16)
    with pytest.raises(RuntimeError, match="length out of range"):
        native(torch.zeros(1, 1, 1, 16), cache[0], cache[1], torch.tensor([17]), 0.25)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMOLSERVE_NATIVE_KERNELS", "0")
    kernels.native_ops.cache_clear()
    try:
        assert kernels.native_ops() is None
        assert kernels.decode_attention() is None
    finally:
        kernels.native_ops.cache_clear()


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_fused_element_wise_ops_match_torch(rows: int) -> None:
    """bfloat16 results within one rounding of torch's (the sums of squares add up in another order)."""
    ops = kernels.native_ops()
    assert ops is not None
    torch.manual_seed(rows)
    bf16 = torch.bfloat16
    hidden, delta, weight = torch.randn(rows, 576, dtype=bf16), torch.randn(rows, 576, dtype=bf16), torch.randn(576)
    expected = _add_norm(hidden, delta, weight.to(bf16), 1e-5)
    for got, want in zip(ops.add_rms_norm(hidden, delta, weight.to(bf16), 1e-5), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    # RoPE over the q and k heads of a fused projection: a view whose rows are strided.
    heads = torch.randn(rows, 15, 64, dtype=bf16)[:, :12]
    cos, sin = torch.randn(rows, 64, dtype=bf16), torch.randn(rows, 64, dtype=bf16)
    torch.testing.assert_close(ops.rope(heads, cos, sin), _rope(heads, cos, sin), atol=1e-2, rtol=1e-2)
    gate_up = torch.randn(rows, 2 * 1536, dtype=bf16)
    torch.testing.assert_close(ops.silu_mul(gate_up), _silu_mul(gate_up), atol=1e-2, rtol=1e-2)


def test_fused_ops_reject_other_dtypes() -> None:
    ops = kernels.native_ops()
    assert ops is not None
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.silu_mul(torch.zeros(2, 8))


def test_tiled_keys_hold_each_tile_as_pairs_of_dims() -> None:
    keys = torch.arange(2 * 32 * 4, dtype=torch.float32).reshape(2, 32, 4)  # [heads, positions, dim]
    tiled = tile_keys(keys).reshape(2, 2, 4 // 2, KEY_TILE, 2)  # [heads, tile, dim pair, position, dim]
    assert tiled.shape == (2, 2, 2, 16, 2)
    for position in (0, 5, 16, 31):
        for dim in range(4):
            expected = keys[1, position, dim]
            assert tiled[1, position // 16, dim // 2, position % 16, dim % 2] == expected
