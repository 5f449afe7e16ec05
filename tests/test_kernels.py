"""The native ops against the torch code they replace, and the switch that turns them off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.runtime import kernels
from engine.runtime.kv_cache import KEY_TILE, tile_keys, untile_keys
from engine.runtime.model_runner import _add_norm, _gelu_mul, _rope, _silu_mul


def _reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int], window: int = 0
) -> torch.Tensor:
    """Each sequence alone through scaled_dot_product_attention, in float32, over its positions
    ``length - window .. length - 1`` (all of them when ``window`` is 0)."""
    starts = [max(0, length - window) if window else 0 for length in lengths]
    rows = [
        F.scaled_dot_product_attention(
            query[i : i + 1].float(), keys[i : i + 1, :, start:length].float(),
            values[i : i + 1, :, start:length].float(),
        )[0]
        for i, (start, length) in enumerate(zip(starts, lengths, strict=True))
    ]  # fmt: skip
    return torch.stack(rows)


def _blocks(rows: int, positions: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables for ``rows`` sequences of ``positions`` positions each, over a pool with two spare blocks, the
    blocks handed out in a shuffled order: ``(tables [rows, width] int32, physical [rows, positions])``."""
    width = positions // block_size
    order = torch.randperm(rows * width + 2, generator=torch.Generator().manual_seed(seed))[: rows * width]
    tables = order.reshape(rows, width).to(torch.int32)
    physical = (tables[:, :, None].long() * block_size + torch.arange(block_size)).flatten(1)
    return tables, physical


def _paged(per_row: torch.Tensor, physical: torch.Tensor, pool_positions: int) -> torch.Tensor:
    """``per_row`` ``[rows, heads, positions, dim]`` placed in a pool ``[heads, pool_positions, dim]``."""
    rows, heads, positions, dim = per_row.shape
    pool = torch.zeros(heads, pool_positions, dim, dtype=per_row.dtype)
    pool[:, physical.flatten()] = per_row.transpose(0, 1).reshape(heads, rows * positions, dim)
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Query heads per KV head past what one pass holds in registers (4 at dim 64, 2 at 128, 1 at 256 and 512), a head size
# the kernel has no specialization for, and Gemma 4's global heads (512 wide, 8 to a KV head).
@pytest.mark.parametrize(
    ("kv_heads", "groups", "dim"),
    [(3, 3, 64), (1, 6, 64), (2, 1, 128), (1, 3, 128), (1, 4, 24), (1, 4, 256), (1, 8, 512)],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_torch_attention(
    dtype: torch.dtype, kv_heads: int, groups: int, dim: int, block_size: int
) -> None:
    """Each row reads its sequence's positions through its block table, the blocks scattered over the pool."""
    native = kernels.decode_attention()
    assert native is not None, "the kernel should build wherever the test suite runs (it has a C++ compiler)"
    torch.manual_seed(0)
    # One position, either side of a 16-position tile and of a 64-position block of scores, odd and even.
    lengths = [1, 15, 16, 17, 63, 64, 65, 200]
    keys, values = (torch.randn(len(lengths), kv_heads, 256, dim, dtype=dtype) for _ in range(2))
    query = torch.randn(len(lengths), kv_heads, groups, dim, dtype=dtype)
    tables, physical = _blocks(len(lengths), 256, block_size, seed=dim)
    pool_positions = (len(lengths) * 256 // block_size + 2) * block_size
    key_pool, value_pool = _paged(tile_keys(keys), physical, pool_positions), _paged(values, physical, pool_positions)
    out = native(query, key_pool, value_pool, tables, torch.tensor(lengths), block_size, dim**-0.5)
    assert out.dtype == dtype and out.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), _reference(query, keys, values, lengths), atol=tolerance, rtol=tolerance)
    # Rows may share a block table through a stride-0 view (a prompt chunk's rows read one sequence's blocks).
    shared = native(query[:3], key_pool, value_pool, tables[7:8].expand(3, -1), torch.tensor([5, 40, 200]),
                    block_size, dim**-0.5)  # fmt: skip
    expected = _reference(query[:3], keys[7:8].expand(3, -1, -1, -1), values[7:8].expand(3, -1, -1, -1), [5, 40, 200])
    torch.testing.assert_close(shared.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "groups", "dim"), [(2, 2, 64), (1, 3, 128), (1, 2, 24), (1, 4, 256)])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 512])
def test_a_sliding_window_attends_only_each_row_s_last_positions(
    dtype: torch.dtype, kv_heads: int, groups: int, dim: int, window: int
) -> None:
    """Gemma 3's local layers: a row of length L attends positions L - window .. L - 1, the window starting
    anywhere in a tile (and longer than some rows: then all of them), on the float and the 8-bit cache alike."""
    native, ops = kernels.decode_attention(), kernels.native_ops()
    assert native is not None and ops is not None
    torch.manual_seed(window)
    lengths = [1, 15, 16, 17, 33, 64, 65, 100, 200]
    keys, values = (torch.randn(len(lengths), kv_heads, 208, dim, dtype=dtype) for _ in range(2))
    query = torch.randn(len(lengths), kv_heads, groups, dim, dtype=dtype)
    tables, physical = _blocks(len(lengths), 208, 16, seed=dim)
    pool = (len(lengths) * 13 + 2) * 16
    want = _reference(query, keys, values, lengths, window)
    key_pool, value_pool = _paged(tile_keys(keys), physical, pool), _paged(values, physical, pool)
    out = native(query, key_pool, value_pool, tables, torch.tensor(lengths), 16, dim**-0.5, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tolerance, rtol=tolerance)
    cache = _int8_cache(keys, values, physical, pool)
    out = ops.decode_attention_int8(query, *cache, tables, torch.tensor(lengths), 16, dim**-0.5, window)
    restored = [t[:, physical].transpose(0, 1) for t in dequantize(*cache)]
    torch.testing.assert_close(out.float(), _reference(query, *restored, lengths, window), atol=3e-2, rtol=3e-2)


def _reference_with_sinks(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int], window: int, sinks: torch.Tensor
) -> torch.Tensor:
    """``_reference`` with an attention sink per query head, as transformers' gpt-oss computes it: one more logit
    in each softmax, its weight dropped before the values."""
    rows = []
    for i, length in enumerate(lengths):
        start = max(0, length - window) if window else 0
        q = query[i].float()  # [kv_heads, groups, dim]
        scores = q @ keys[i, :, start:length].float().transpose(-1, -2) * q.shape[-1] ** -0.5
        logits = torch.cat([scores, sinks.view(q.shape[0], q.shape[1], 1).expand(-1, -1, 1)], dim=-1)
        rows.append(torch.softmax(logits, dim=-1)[..., :-1] @ values[i, :, start:length].float())
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "groups", "dim"), [(2, 4, 64), (1, 3, 128), (1, 2, 24), (2, 1, 64)])
@pytest.mark.parametrize("window", [0, 17])
def test_attention_sinks_take_their_share_of_each_head_s_weight(
    dtype: torch.dtype, kv_heads: int, groups: int, dim: int, window: int
) -> None:
    """gpt-oss's sinks: each query head's learned logit joins its softmax's denominator (heads with sinks far above,
    near and below their scores), on the float and the 8-bit cache and in torch's fallback alike."""
    from engine.runtime.attention import _with_sinks

    native, ops = kernels.decode_attention(), kernels.native_ops()
    assert native is not None and ops is not None
    torch.manual_seed(dim + window)
    lengths = [1, 16, 17, 64, 100]
    keys, values = (torch.randn(len(lengths), kv_heads, 112, dim, dtype=dtype) for _ in range(2))
    query = torch.randn(len(lengths), kv_heads, groups, dim, dtype=dtype)
    sinks = torch.linspace(-4.0, 6.0, kv_heads * groups)
    tables, physical = _blocks(len(lengths), 112, 16, seed=dim)
    pool = (len(lengths) * 7 + 2) * 16
    want = _reference_with_sinks(query, keys, values, lengths, window, sinks)
    assert not torch.allclose(want, _reference(query, keys, values, lengths, window), atol=1e-2)  # the sinks count
    key_pool, value_pool = _paged(tile_keys(keys), physical, pool), _paged(values, physical, pool)
    out = native(query, key_pool, value_pool, tables, torch.tensor(lengths), 16, dim**-0.5, window, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tolerance, rtol=tolerance)
    cache = _int8_cache(keys, values, physical, pool)
    out = ops.decode_attention_int8(query, *cache, tables, torch.tensor(lengths), 16, dim**-0.5, window, sinks)
    restored = [t[:, physical].transpose(0, 1) for t in dequantize(*cache)]
    torch.testing.assert_close(
        out.float(), _reference_with_sinks(query, *restored, lengths, window, sinks), atol=3e-2, rtol=3e-2
    )
    row = 3  # torch's fallback: one decoding row over its positions
    length = lengths[row]
    mask = (torch.arange(length) >= length - window) if window else None
    fallback = _with_sinks(
        query[row : row + 1].float(),
        keys[row : row + 1, :, :length].float(),
        values[row : row + 1, :, :length].float(),
        mask,
        dim**-0.5,
        sinks.view(kv_heads, groups, 1),
    )
    torch.testing.assert_close(fallback[0], want[row], atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "groups", "dim"), [(2, 7, 64), (1, 3, 128), (1, 4, 24), (2, 3, 256), (1, 8, 512)])
def test_a_prompt_chunk_s_rows_attend_as_each_would_alone(
    dtype: torch.dtype, kv_heads: int, groups: int, dim: int
) -> None:
    """A prompt chunk's rows read one sequence's blocks (on AVX2 the float kernel, on AVX512-BF16 the bfloat16 one,
    takes up to 32 of them at a time, reading each tile once for all): every row's output is bitwise what it is
    alone, as a decoding row, and
    whatever cut of the prompt into chunks put it beside other rows (batch-invariant greedy rests on it). A row
    of another sequence between them, and one whose table differs in a block it reads, are not taken along."""
    native = kernels.decode_attention()
    assert native is not None
    torch.manual_seed(dim)
    positions, block_size = 1056, 32
    keys, values = (torch.randn(2, kv_heads, positions, dim, dtype=dtype) for _ in range(2))
    tables, physical = _blocks(2, positions, block_size, seed=dim)
    pool = (2 * positions // block_size + 2) * block_size
    key_pool, value_pool = _paged(tile_keys(keys), physical, pool), _paged(values, physical, pool)
    lengths = list(range(1000, 1040))
    query = torch.randn(len(lengths), kv_heads, groups, dim, dtype=dtype)

    def attend(rows: list[int], table_rows: list[int], table: torch.Tensor = tables) -> torch.Tensor:
        return native(query[rows], key_pool, value_pool, table[table_rows], torch.tensor([lengths[r] for r in rows]),
                      block_size, dim**-0.5)  # fmt: skip

    alone = torch.cat([attend([r], [0]) for r in range(len(lengths))])
    for cut in (1, 3, 8, 13, 40):  # chunks of the prompt, each call holding one
        chunks = [list(range(start, min(start + cut, len(lengths)))) for start in range(0, len(lengths), cut)]
        assert torch.equal(torch.cat([attend(rows, [0] * len(rows)) for rows in chunks]), alone), cut
    # Rows of another sequence interleaved, and a table differing in the last block only the longer row reads.
    mixed = attend([0, 1, 2, 3], [0, 1, 0, 1])
    assert torch.equal(mixed[0::2], alone[0:4:2])
    torch.testing.assert_close(mixed[1], attend([1], [1])[0], atol=0, rtol=0)
    torch.testing.assert_close(alone[:2].float(), _reference(query[:2], keys[:1].expand(2, -1, -1, -1),
                                                     values[:1].expand(2, -1, -1, -1), lengths[:2]),
                               atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)  # fmt: skip
    forked = tables[[0, 0]].clone()
    forked[1, 1000 // block_size] = tables[1, 0]  # the second row's block holding position 1000 is elsewhere
    out = native(query[:2], key_pool, value_pool, forked, torch.tensor([1000, 1001]), block_size, dim**-0.5)
    assert torch.equal(out[0], alone[0])
    assert not torch.equal(out[1], alone[1])


def test_kernel_rejects_lengths_and_blocks_beyond_the_cache() -> None:
    native = kernels.decode_attention()
    assert native is not None
    pool = torch.zeros(1, 32, 16)  # two blocks of 16
    query, table = torch.zeros(1, 1, 1, 16), torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="length out of range"):
        native(query, pool, pool, table, torch.tensor([33]), 16, 0.25)
    with pytest.raises(RuntimeError, match="block id out of range"):
        native(query, pool, pool, torch.tensor([[0, 2]], dtype=torch.int32), torch.tensor([20]), 16, 0.25)
    with pytest.raises(RuntimeError, match="whole tiles"):
        native(query, pool, pool, table, torch.tensor([4]), 8, 0.25)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMOLSERVE_NATIVE_KERNELS", "0")
    kernels.native_ops.cache_clear()
    try:
        assert kernels.native_ops() is None
        assert kernels.decode_attention() is None
    finally:
        kernels.native_ops.cache_clear()


@pytest.mark.parametrize("rows", [1, 32, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_element_wise_ops_match_torch(rows: int, dtype: torch.dtype) -> None:
    """bfloat16 results within one rounding of torch's (the sums of squares add up in another order); float32
    ones within float32's."""
    ops = kernels.native_ops()
    assert ops is not None
    torch.manual_seed(rows)
    close = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    hidden, delta, weight = torch.randn(rows, 576, dtype=dtype), torch.randn(rows, 576, dtype=dtype), torch.randn(576)
    expected = _add_norm(hidden, delta, weight.to(dtype), 1e-5)
    for got, want in zip(ops.add_rms_norm(hidden, delta, weight.to(dtype), 1e-5), expected, strict=True):
        torch.testing.assert_close(got, want, **close)
    # RoPE over the q and k heads of a fused projection: a view whose rows are strided.
    heads = torch.randn(rows, 15, 64, dtype=dtype)[:, :12]
    cos, sin = torch.randn(rows, 64, dtype=dtype), torch.randn(rows, 64, dtype=dtype)
    torch.testing.assert_close(ops.rope(heads, cos, sin), _rope(heads, cos, sin), **close)
    gate_up = torch.randn(rows, 2 * 1536, dtype=dtype)
    torch.testing.assert_close(ops.silu_mul(gate_up), _silu_mul(gate_up), **close)
    torch.testing.assert_close(ops.gelu_mul(gate_up), _gelu_mul(gate_up), **close)  # Gemma's
    # Gemma 3: the block's output normalized by its own weights before it joins the residual stream.
    delta_weight = torch.rand(576).to(dtype) + 0.5
    expected = _add_norm(hidden, delta * 30, weight.to(dtype), 1e-5, delta_weight)
    # One rounding of a normalized output of ~2-4 is 1/64: where the sum cancels, that is its whole error.
    summed = {**close, "atol": 2e-2} if dtype == torch.bfloat16 else close
    for got, want in zip(ops.add_rms_norm(hidden, delta * 30, weight.to(dtype), 1e-5, delta_weight), expected,
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, **summed)


def test_fused_ops_reject_other_dtypes() -> None:
    ops = kernels.native_ops()
    assert ops is not None
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="like the rows"):
        ops.rope(torch.zeros(2, 1, 8), torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8))


def test_tiled_keys_hold_each_tile_as_pairs_of_dims() -> None:
    keys = torch.arange(2 * 32 * 4, dtype=torch.float32).reshape(2, 32, 4)  # [heads, positions, dim]
    tiled = tile_keys(keys).reshape(2, 2, 4 // 2, KEY_TILE, 2)  # [heads, tile, dim pair, position, dim]
    assert tiled.shape == (2, 2, 2, 16, 2)
    for position in (0, 5, 16, 31):
        for dim in range(4):
            expected = keys[1, position, dim]
            assert tiled[1, position // 16, dim // 2, position % 16, dim % 2] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "dim"), [(3, 64), (1, 24)])
def test_native_write_stores_rows_as_the_torch_write_does(dtype: torch.dtype, kv_heads: int, dim: int) -> None:
    ops = kernels.native_ops()
    assert ops is not None
    pool = torch.zeros(2, kv_heads, 64, dim, dtype=dtype)  # [keys / values, heads, positions, dim]
    expected = pool.clone()
    slots = torch.tensor([37, 0, 15, 16, 63])  # across tiles, both ends of a tile
    key, value = (torch.randn(5, kv_heads, dim).to(dtype) for _ in range(2))
    ops.write_kv(pool[0], pool[1], slots.to(torch.int32), key.transpose(1, 2).contiguous().transpose(1, 2), value)
    expected[0][:, slots] = key.transpose(0, 1)
    expected[1][:, slots] = value.transpose(0, 1)
    assert torch.equal(pool[0], tile_keys(expected[0]))  # keys into their tiles, the rest untouched
    assert torch.equal(pool[1], expected[1])
    assert torch.equal(untile_keys(pool[0])[:, slots].transpose(0, 1), key)


def test_native_write_rejects_what_it_cannot_store() -> None:
    ops = kernels.native_ops()
    assert ops is not None
    keys, values = torch.zeros(2, 32, 8), torch.zeros(2, 32, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.write_kv(keys, values, torch.tensor([32]), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.write_kv(keys, values, torch.tensor([1]), torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 8))
    with pytest.raises(RuntimeError, match="whole tiles"):
        ops.write_kv(torch.zeros(2, 20, 8), torch.zeros(2, 20, 8), torch.tensor([1]), torch.zeros(1, 2, 8),
                     torch.zeros(1, 2, 8))  # fmt: skip


# -- the 8-bit KV cache -------------------------------------------------------------------------------------


def _int8_cache(keys: torch.Tensor, values: torch.Tensor, physical: torch.Tensor, pool_positions: int) -> tuple:
    """``keys``, ``values`` ``[n, kv_heads, positions, dim]`` written by the native op into an 8-bit pool
    ``[kv_heads, pool_positions, dim]`` at ``physical`` ``[n, positions]``, as the engine writes each token:
    (keys, values, key_scales, value_scales)."""
    ops = kernels.native_ops()
    assert ops is not None
    n, heads, positions, dim = keys.shape
    cache_keys, cache_values = (torch.zeros(heads, pool_positions, dim, dtype=torch.uint8) for _ in range(2))
    key_scales, value_scales = torch.zeros(heads, pool_positions), torch.zeros(heads, pool_positions)
    as_rows = [t.transpose(1, 2).reshape(n * positions, heads, dim) for t in (keys, values)]
    ops.write_kv_int8(cache_keys, cache_values, key_scales, value_scales, physical.flatten(), *as_rows)
    return cache_keys, cache_values, key_scales, value_scales


def dequantize(
    keys: torch.Tensor, values: torch.Tensor, key_scales: torch.Tensor, value_scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit cache's layouts, undone: keys offset by 128 in tiles of 16 positions laid out [dim / 4][16][4],
    values in pairs of positions laid out [dim][2]; each row times its scale."""
    *lead, positions, dim = keys.shape
    k = keys.reshape(*lead, positions // 16, dim // 4, 16, 4).transpose(-3, -2).reshape(*lead, positions, dim)
    v = values.view(torch.int8).reshape(*lead, positions // 2, dim, 2).transpose(-2, -1).reshape(keys.shape)
    return (k.float() - 128) * key_scales[..., None], v.float() * value_scales[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_write_quantizes_each_row_by_its_largest(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    keys, values = torch.randn(2, 3, 48, 64, dtype=dtype), torch.randn(2, 3, 48, 64, dtype=dtype) * 5
    _, physical = _blocks(2, 48, 16, seed=1)
    cache = _int8_cache(keys, values, physical, 8 * 16)
    restored_keys, restored_values = dequantize(*cache)
    for original, restored, scales in zip((keys, values), (restored_keys, restored_values), cache[2:], strict=True):
        per_row = restored[:, physical].transpose(0, 1)  # [n, heads, positions, dim]
        row_scales = scales[:, physical].transpose(0, 1)
        torch.testing.assert_close(row_scales, original.float().abs().amax(-1) / 127)
        assert ((per_row - original.float()).abs() <= row_scales[..., None] * 0.5001).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Head sizes 64 and 128 take the VNNI kernel (query heads per KV head past one pass: 6 at 64, 3 at 128),
# 24 the portable loops.
@pytest.mark.parametrize(("kv_heads", "groups", "dim"), [(3, 3, 64), (1, 6, 64), (2, 1, 128), (1, 3, 128), (1, 4, 24)])
def test_int8_kernel_matches_attention_over_its_cache(dtype: torch.dtype, kv_heads: int, groups: int, dim: int) -> None:
    """Against exact attention over the dequantized cache: what is left is the kernel's own rounding of the
    query (8 bits, a scale per 32 dims) and of the probabilities (15 bits). The blocks are scattered over the
    pool, so a 64-position block of weights spans several of them."""
    ops = kernels.native_ops()
    assert ops is not None
    torch.manual_seed(0)
    lengths = [1, 2, 3, 15, 16, 17, 63, 64, 65, 200]
    keys, values = (torch.randn(len(lengths), kv_heads, 208, dim, dtype=dtype) for _ in range(2))
    query = torch.randn(len(lengths), kv_heads, groups, dim, dtype=dtype)
    tables, physical = _blocks(len(lengths), 208, 16, seed=dim)
    cache = _int8_cache(keys, values, physical, (len(lengths) * 13 + 2) * 16)
    out = ops.decode_attention_int8(query, *cache, tables, torch.tensor(lengths), 16, dim**-0.5)
    assert out.dtype == dtype and out.shape == query.shape
    restored = [t[:, physical].transpose(0, 1) for t in dequantize(*cache)]
    torch.testing.assert_close(out.float(), _reference(query, *restored, lengths), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), _reference(query, keys, values, lengths), atol=6e-2, rtol=6e-2)


def test_int8_kernel_rejects_a_cache_of_another_dtype() -> None:
    ops = kernels.native_ops()
    assert ops is not None
    cache = torch.zeros(1, 16, 16)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.decode_attention_int8(
            torch.zeros(1, 1, 1, 16), cache, cache, cache[..., 0], cache[..., 0],
            torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]), 16, 1.0,
        )  # fmt: skip
