"""Every GGML type the native matmul reads, on random blocks (hypothesis): rows dequantized from the packed blocks
bit for bit as gguf-py's reference does, products equal to the float reference of the same integers (the weights
as GGUF dequantizes them times the activations as the kernel rounds them to 8 bits per block of 32) within float32
rounding and one activation step a block, the AVX2 path bitwise the portable loops, and a row the same whatever
shares its call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import GGMLQuantizationType, dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime import kernels
from engine.runtime.quantized_weights import SUPPORTED

T = GGMLQuantizationType
#: Where each type's fp16 scales (d, and dmin or m) sit in its block: random bytes there could be inf or NaN.
HALF_SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.IQ4_NL: [0], T.Q2_K: [80, 82],
    T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_XS: [0], T.MXFP4: [],
}  # fmt: skip
#: ... and where an E8M0 exponent sits (MXFP4's scale 2^(e - 128)): random bytes there overflow float32's products.
E8M0_SCALES = {T.MXFP4: 0}
TYPES = list(HALF_SCALES)


def test_every_listed_type_is_read() -> None:
    assert {t.name for t in TYPES} == set(SUPPORTED) and all(SUPPORTED[t.name] == int(t) for t in TYPES)


def random_blocks(qtype: T, out: int, blocks: int, seed: int, scale: float = 0.02) -> np.ndarray:
    """``out`` rows of ``blocks`` random blocks (any bytes are valid quants and sub-scales) with finite fp16 scales
    of either sign up to ``scale``: GGML's bytes, ``[out, bytes]``."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (out, blocks, size), dtype=np.uint8)
    for at in HALF_SCALES[qtype]:
        raw[..., at : at + 2] = rng.uniform(-scale, scale, (out, blocks, 1)).astype(np.float16).view(np.uint8)
    if qtype in E8M0_SCALES:  # weights up to 12 x 2^(e - 128): about `scale` at most
        top = 128 + int(np.floor(np.log2(scale / 12)))
        raw[..., E8M0_SCALES[qtype]] = rng.integers(top - 6, top + 1, (out, blocks), dtype=np.uint8)
    return raw.reshape(out, -1)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel multiplies it: each block of 32 rounded to int8 steps of max|x| / 127."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks * torch.where(scale > 0, 1 / scale, 0), 0).round()
    return (q * scale).reshape(x.shape)


def ops():
    native = kernels.native_ops()
    assert native is not None
    return native


@settings(max_examples=12, deadline=None)
@given(qtype=st.sampled_from(TYPES), out=st.integers(1, 20), seed=st.integers(0, 2**31))
def test_rows_dequantize_bitwise_as_gguf_does(qtype: T, out: int, seed: int) -> None:
    weights_per_block, _ = GGML_QUANT_SIZES[qtype]
    blocks = 512 // weights_per_block
    raw = random_blocks(qtype, out, blocks, seed)
    packed = ops().quant_pack(torch.from_numpy(raw), int(qtype))
    index = torch.tensor([out - 1, 0, *range(out)])  # the last group's last row, repeats, every column
    rows = ops().quant_rows(packed, int(qtype), index)
    assert torch.equal(rows, torch.from_numpy(dequantize(raw, qtype).copy())[index])


@settings(max_examples=24, deadline=None)
@given(
    qtype=st.sampled_from(TYPES),
    rows=st.sampled_from([1, 2, 3, 4, 5, 9, 64, 67]),
    out=st.integers(1, 19),
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_products_are_the_float_reference_of_the_same_integers(
    qtype: T, rows: int, out: int, seed: int, dtype: torch.dtype
) -> None:
    weights_per_block, _ = GGML_QUANT_SIZES[qtype]
    inp = 2 * max(weights_per_block, 64)
    raw = random_blocks(qtype, out, inp // weights_per_block, seed)
    dense = torch.from_numpy(dequantize(raw, qtype).copy()).double()
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(seed)).to(dtype)
    packed = ops().quant_pack(torch.from_numpy(raw), int(qtype))
    got = ops().quant_linear(x, packed, int(qtype), out, False)
    want = q8_activations(x).double() @ dense.T
    bound = (q8_activations(x).double().abs() @ dense.abs().T) * 1e-5 + 1e-6  # float32 sums of ~100 terms
    # The kernel's 1 / scale is the compiler's fast reciprocal: a value at a rounding tie may land one step over.
    steps = x.float().reshape(rows, -1, 32).abs().amax(-1).double() / 127  # [rows, blocks]
    bound = bound + steps @ dense.abs().reshape(out, -1, 32).amax(-1).T
    if dtype == torch.bfloat16:
        bound = bound + want.abs() / 128  # the result rounded to bfloat16
    assert got.dtype == dtype and got.shape == (rows, out)
    assert ((got.double() - want).abs() <= bound).all()
    for path in ops().quant_paths():  # the plain loops, AVX2, AVX-512 VNNI: bitwise the same
        assert torch.equal(got, ops().quant_linear(x, packed, int(qtype), out, path)), path
    for row in {0, rows - 1}:
        assert torch.equal(ops().quant_linear(x[row : row + 1], packed, int(qtype), out, False)[0], got[row])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_extreme_quants_and_activations_do_not_overflow(qtype: T) -> None:
    """Every quant byte at 0xFF or 0x00 (the largest 4/5-bit values, int8 -1 or 0, the widest table entries)
    against activations all at +-127: the widest integer sums the kernel's 16-bit lanes see."""
    weights_per_block, _ = GGML_QUANT_SIZES[qtype]
    for fill in (0xFF, 0x00, 0x77):
        raw = random_blocks(qtype, 8, 256 // weights_per_block, seed=fill)
        kept = [a + i for a in HALF_SCALES[qtype] for i in (0, 1)]
        kept += [E8M0_SCALES[qtype]] if qtype in E8M0_SCALES else []
        scales = raw.reshape(8, 256 // weights_per_block, -1)[..., kept]
        raw.reshape(8, 256 // weights_per_block, -1)[:] = fill
        raw.reshape(8, 256 // weights_per_block, -1)[..., kept] = scales
        dense = torch.from_numpy(dequantize(raw, qtype).copy()).double()
        packed = ops().quant_pack(torch.from_numpy(raw), int(qtype))
        for sign in (1.0, -1.0):
            x = torch.full((3, 256), sign)
            want = x.double() @ dense.T
            got = ops().quant_linear(x, packed, int(qtype), 8, False).double()
            assert ((got - want).abs() <= want.abs().max() * 1e-5 + 1e-6).all(), (fill, sign)


@settings(max_examples=16, deadline=None)
@given(
    qtype=st.sampled_from(TYPES),
    rows=st.sampled_from([1, 3, 4, 5, 7, 8, 9, 16, 63, 64, 65, 130, 300]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
)
def test_every_path_gives_the_same_bits_at_every_row_count_and_thread_count(
    qtype: T, rows: int, threads: int, seed: int
) -> None:
    """What the CPU class may change (which kernel runs, how many rows share a tile, how many threads split the
    groups) changes no bit of a row's result: its integer block sums are exact and its float operations keep one
    order."""
    weights_per_block, _ = GGML_QUANT_SIZES[qtype]
    inp = 2 * max(weights_per_block, 64)
    raw = random_blocks(qtype, 24, inp // weights_per_block, seed)
    packed = ops().quant_pack(torch.from_numpy(raw), int(qtype))
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(seed)).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = {path: ops().quant_linear(x, packed, int(qtype), 24, path) for path in ops().quant_paths()}
        picked = sorted({0, rows // 2, rows - 1})
        alone = [ops().quant_linear(x[r : r + 1], packed, int(qtype), 24, 0)[0] for r in picked]
    finally:
        torch.set_num_threads(before)
    first = next(iter(results.values()))
    assert all(torch.equal(first, result) for result in results.values())
    assert all(torch.equal(row, first[r]) for row, r in zip(alone, picked, strict=True))


def test_the_paths_this_cpu_class_runs() -> None:
    """The plain loops everywhere; AVX2 on every x86 class this project meets; AVX-512 VNNI where the CPU has it
    (AMD Zen 4, Intel Sapphire Rapids), never elsewhere."""
    from pathlib import Path

    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line.split() for line in lines if line.startswith("flags")), [])
    paths = list(ops().quant_paths())
    assert paths[0] == 1
    assert (2 in paths) == ("avx2" in flags)
    assert (3 in paths) == ("avx512_vnni" in flags and "avx512vl" in flags)


@pytest.mark.parametrize("rows", [1, 5, 67])
def test_mxfp4_stays_4_bit_in_memory_and_every_path_multiplies_it_alike(rows: int) -> None:
    """gpt-oss's experts: 8 rows' blocks of 32 packed as 8 float32 scales and 128 bytes of nibbles (20 bytes a block,
    near the file's 17; its values as int8 took 36, and a 20B's experts did not fit in 24 GB), the nibbles looked up
    in MXFP4's table by the kernel: products the float reference's, the same bits on every path."""
    raw = random_blocks(T.MXFP4, 16, 8, seed=rows)
    packed = ops().quant_pack(torch.from_numpy(raw), int(T.MXFP4))
    assert packed.shape == (2, 8 * 160)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    dense = torch.from_numpy(dequantize(raw, T.MXFP4).copy()).double()
    got = [ops().quant_linear(x, packed, int(T.MXFP4), 16, path) for path in ops().quant_paths()]
    assert all(torch.equal(other, got[0]) for other in got[1:])
    want = q8_activations(x).double() @ dense.T
    steps = x.reshape(rows, -1, 32).abs().amax(-1).double() / 127 @ dense.abs().reshape(16, -1, 32).amax(-1).T
    assert ((got[0].double() - want).abs() <= want.abs() * 1e-5 + 1e-6 + steps).all()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_k_quants_stay_near_the_file_s_size_and_every_path_multiplies_them_alike(qtype: T) -> None:
    """A Q4_K_M file's types (Q4_K, Q6_K; Q5_K for Q5_K_M) packed with their scales as the file's small integers and
    each super-block's fp16 d beside 8 rows (within 3% of the file's bytes: float32 scales made Q4_K 1.33x and Q6_K
    1.52x, and a 30B-A3B's 18 GB of experts 24 GB): products the float reference's, the same bits on every path."""
    raw = random_blocks(qtype, 16, 4, seed=int(qtype))
    packed = ops().quant_pack(torch.from_numpy(raw), int(qtype))
    assert packed.numel() <= raw.nbytes * 1.03
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(int(qtype)))
    dense = torch.from_numpy(dequantize(raw, qtype).copy()).double()
    got = [ops().quant_linear(x, packed, int(qtype), 16, path) for path in ops().quant_paths()]
    assert all(torch.equal(other, got[0]) for other in got[1:])
    want = q8_activations(x).double() @ dense.T
    steps = x.reshape(9, -1, 32).abs().amax(-1).double() / 127 @ dense.abs().reshape(16, -1, 32).amax(-1).T
    assert ((got[0].double() - want).abs() <= want.abs() * 1e-5 + 1e-6 + steps).all()
