"""The native matmul on GGUF quantized weights (Q4_0, Q4_1, Q8_0, packed 8 rows at a time) against
dequantize-then-matmul, its portable loops against its AVX2 path, and rows computed alike whatever shares their call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from engine.runtime import kernels
from engine.runtime.quantized_weights import PackedParts, PackedWeight, QuantizedWeight, int8_weight, int8_weights

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def quantized_weight(out: int, inp: int, qtype: GGMLQuantizationType, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights in ``qtype``'s blocks (GGML's bytes, [out, bytes]) and their dequantized float32 values."""
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((out, inp)).astype(np.float32), qtype)
    return torch.from_numpy(raw.copy()), torch.from_numpy(dequantize(raw, qtype).copy())


K_TYPES = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K]


def random_k_blocks(
    out: int, inp: int, qtype: GGMLQuantizationType, seed: int, scale: tuple[float, float] = (0.001, 0.02)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K-quant blocks (gguf has no quantizer for them: any bytes are valid quants and scales, with finite
    fp16 super-scales in ``scale`` set here) and their dequantized float32 values, by gguf's reference."""
    rng = np.random.default_rng(seed)
    size = 144 if qtype == GGMLQuantizationType.Q4_K else 210
    raw = rng.integers(0, 256, (out, inp // 256, size), dtype=np.uint8)
    scales = rng.uniform(*scale, (out, inp // 256, 2)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:
        raw[..., :4] = scales.reshape(out, inp // 256, 4)  # d, dmin
    else:
        raw[..., 208:] = scales.reshape(out, inp // 256, 4)[..., :2]  # d
    raw = raw.reshape(out, -1)
    return torch.from_numpy(raw.copy()), torch.from_numpy(dequantize(raw, qtype).copy())


def ops():
    native = kernels.native_ops()
    assert native is not None
    return native


def packed(weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    return ops().quant_pack(weight, int(qtype))


def matmul(x: torch.Tensor, weight: torch.Tensor, qtype: GGMLQuantizationType, portable: bool = False) -> torch.Tensor:
    return ops().quant_linear(x, packed(weight, qtype), int(qtype), weight.shape[0], 1 if portable else 0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantize_then_matmul(qtype: GGMLQuantizationType, rows: int, dtype: torch.dtype) -> None:
    """What is left is the activations' 8-bit rounding per block of 32: about 1% of an output's typical size.
    67 outputs: a last group of 8 with 3 rows; 70 rows: more than one 64-row sweep, a last tile of 2."""
    weight, dense = quantized_weight(67, 96, qtype, seed=rows)  # three blocks a row
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = matmul(x, weight, qtype)
    assert got.dtype == dtype and got.shape == (rows, 67)
    want = x.float() @ dense.T
    scale = want.abs().mean()
    assert (got.float() - want).abs().max() <= 0.03 * scale + (0.02 * scale if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 67])
def test_portable_loops_agree_with_the_native_path(qtype: GGMLQuantizationType, rows: int) -> None:
    """The same integers and the same float operations in the same order: equal, bit for bit."""
    weight, _ = quantized_weight(43, 64, qtype, seed=7)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7))
    assert torch.equal(matmul(x, weight, qtype), matmul(x, weight, qtype, portable=True))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_comes_out_the_same_whatever_shares_its_call(qtype: GGMLQuantizationType) -> None:
    weight, _ = quantized_weight(50, 64, qtype, seed=3)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(3))
    together = matmul(x, weight, qtype)
    for row in [0, 1, 5, 63, 64, 69]:  # first and last of a tile, of a 64-row sweep, of the call
        assert torch.equal(matmul(x[row : row + 1], weight, qtype)[0], together[row])
        assert torch.equal(matmul(x[row : row + 3], weight, qtype)[0], together[row])


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_k_quants_match_dequantize_then_matmul(qtype: GGMLQuantizationType, rows: int) -> None:
    """Q4_K and Q6_K, their 256-weight blocks unpacked into 32-weight ones with float32 scales: against gguf's own
    dequantization, the AVX2 path bitwise equal to the portable loops, and rows alike alone or together."""
    weight, dense = random_k_blocks(21, 512, qtype, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    got = matmul(x, weight, qtype)
    want = x @ dense.T
    assert (got - want).abs().max() <= 0.03 * want.abs().mean()
    assert torch.equal(got, matmul(x, weight, qtype, portable=True))
    assert torch.equal(matmul(x[-1:], weight, qtype)[0], got[-1])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_extreme_blocks_do_not_overflow(qtype: GGMLQuantizationType) -> None:
    """Every 4-bit weight at 15 (Q8_0: at +-127) against activations all at +127 or -127: the largest sums the
    16-bit lanes hold, and the correct answer."""
    values = np.full((16, 64), -1.0 if qtype == GGMLQuantizationType.Q4_0 else 1.0, dtype=np.float32)
    values[:, ::32] = 1.0 if qtype == GGMLQuantizationType.Q4_0 else 0.0  # sets each block's scale so q = 15
    if qtype == GGMLQuantizationType.Q8_0:
        values[:, ::32] = -1.0  # q = -127 there: both signs
    raw = quantize(values, qtype)
    dense = torch.from_numpy(dequantize(raw, qtype).copy())
    for sign in (1.0, -1.0):
        x = torch.full((3, 64), sign)
        torch.testing.assert_close(matmul(x, torch.from_numpy(raw.copy()), qtype), x @ dense.T, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("qtype", TYPES + K_TYPES, ids=lambda t: t.name)
def test_rows_read_from_blocks_equal_gguf_s_dequantization(qtype: GGMLQuantizationType) -> None:
    """The embedding lookup of a model served from its blocks: any rows (every column of a group of 8, the last
    group's 3 real rows, repeats), each weight exactly as GGUF dequantizes it."""
    make = random_k_blocks if qtype in K_TYPES else quantized_weight
    weight, dense = make(19, 512, qtype, seed=3)
    index = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 18, 16, 9, 9])
    rows = PackedWeight(packed(weight, qtype), int(qtype), 512, 19).rows(index, torch.float32)
    assert torch.equal(rows, dense[index])
    assert PackedWeight(packed(weight, qtype), int(qtype), 512, 19).rows(index, torch.bfloat16).dtype == torch.bfloat16


def test_rows_refuse_an_index_past_the_matrix() -> None:
    weight, _ = quantized_weight(8, 64, GGMLQuantizationType.Q8_0, seed=0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops().quant_rows(packed(weight, GGMLQuantizationType.Q8_0), int(GGMLQuantizationType.Q8_0), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="int64"):
        ops().quant_rows(packed(weight, GGMLQuantizationType.Q8_0), 8, torch.tensor([1], dtype=torch.int32))


def test_refuses_what_it_cannot_read() -> None:
    weight, _ = quantized_weight(4, 64, GGMLQuantizationType.Q4_1, seed=0)
    q4_1 = int(GGMLQuantizationType.Q4_1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops().quant_linear(torch.zeros(1, 40), packed(weight, GGMLQuantizationType.Q4_1), q4_1, 4)
    with pytest.raises(RuntimeError, match="bytes do not match"):
        ops().quant_linear(torch.zeros(1, 64), packed(weight, GGMLQuantizationType.Q4_1), 8, 4)
    with pytest.raises(RuntimeError, match="out_features"):
        ops().quant_linear(torch.zeros(1, 64), packed(weight, GGMLQuantizationType.Q4_1), q4_1, 9)
    with pytest.raises(RuntimeError, match="unsupported quantized type"):
        ops().quant_pack(weight, 16)  # IQ2_XXS
    with pytest.raises(RuntimeError, match="whole blocks"):
        ops().quant_pack(weight[:, :30].contiguous(), q4_1)


# -- served: a llama's matrices in their GGUF blocks -------------------------------------------------------


def quantize_model(model: torch.nn.Module, kind: str) -> dict[str, QuantizedWeight]:
    """Each linear of a llama quantized as ``kind`` (a GGML type's name, or ``int8``: ``--quantization int8``), its
    dense weight replaced by the dequantized values, so both paths hold the same weights; by transformers' name,
    as ``gguf_weights.read`` gives them."""
    quantized = int8_weights(model) if kind == "int8" else {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight.shape[1] % 32 == 0:
            if kind != "int8":
                qtype = GGMLQuantizationType[kind]
                raw = torch.from_numpy(quantize(module.weight.detach().numpy(), qtype).copy())
                quantized[f"{name}.weight"] = QuantizedWeight(raw, int(qtype), module.in_features)
            weight = quantized[f"{name}.weight"]
            restored = dequantize(weight.data.numpy(), GGMLQuantizationType(weight.qtype))
            module.weight.data = torch.from_numpy(restored.copy())
    return quantized


def test_int8_weights_are_per_output_channel() -> None:
    weight = torch.randn(24, 64) * torch.linspace(0.01, 3, 24)[:, None]  # rows of very different sizes
    quantized = int8_weight(weight)
    restored = torch.from_numpy(dequantize(quantized.data.numpy(), GGMLQuantizationType.Q8_0).copy())
    blocks = quantized.data.view(24, 2, 34)
    assert torch.equal(blocks[:, 0, :2], blocks[:, 1, :2])  # one scale a row, in each of its blocks
    row_max = weight.abs().amax(dim=1, keepdim=True)
    assert ((restored - weight).abs() <= row_max / 127 * 0.502).all()  # half a step of the row's own scale
    with pytest.raises(ValueError, match="multiple of 32"):
        int8_weight(torch.randn(4, 40))
    assert torch.equal(int8_weight(torch.zeros(8, 32)).data.view(8, 34)[:, 2:], torch.zeros(8, 32, dtype=torch.uint8))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "int8"])
def test_an_engine_on_quantized_blocks_matches_the_dequantized_one_and_stays_batch_invariant(
    tiny_llama_dir, kind: str
) -> None:
    from engine_helpers import make_engine, prompt_ids, run_outputs
    from transformers import AutoModelForCausalLM

    from engine.core.types import GenerationRequest

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    quantized = quantize_model(model, kind)
    assert "lm_head.weight" in quantized and "model.layers.1.mlp.down_proj.weight" in quantized
    requests = [GenerationRequest(prompt_ids(i, 9 + 13 * i), 12, ignore_eos=True, logprobs=0) for i in range(4)]
    together = run_outputs(make_engine(model, frozenset({7}), quantized=quantized), [(0, r) for r in requests])
    dense = run_outputs(make_engine(model, frozenset({7})), [(0, r) for r in requests])
    for index, request in enumerate(requests):
        alone = run_outputs(make_engine(model, frozenset({7}), quantized=quantized), [(0, request)])[0]
        assert alone == together[index]  # bitwise: tokens and logprobs, alone or in a batch
        # Against the dequantized weights: the activations' 8-bit rounding moves logprobs a little.
        got, want = together[index][0], dense[index][0]
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) < 0.05


@pytest.mark.parametrize("mixed", [False, True], ids=["q4_k", "q4_k_m"])
def test_an_engine_on_k_quant_blocks_matches_the_dequantized_one(mixed: bool) -> None:
    """A llama whose linears and token embedding are Q4_K, and its output layer Q6_K; ``mixed`` as a Q4_K_M file:
    the value and down projections Q6_K too (the fused QKV then multiplies its two types apart, and the layer runs
    op by op). The embedding is looked up in its blocks."""
    from engine_helpers import make_engine, prompt_ids, run_outputs
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.core.types import GenerationRequest

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=7, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    six = ("lm_head", "v_proj", "down_proj") if mixed else ("lm_head",)
    quantized = {}
    for index, (name, module) in enumerate(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            qtype = GGMLQuantizationType.Q6_K if name.endswith(six) else GGMLQuantizationType.Q4_K
            raw, dense = random_k_blocks(module.out_features, module.in_features, qtype, index, (5e-5, 3e-4))
            module.weight.data = dense
            quantized[f"{name}.weight"] = QuantizedWeight(raw, int(qtype), module.in_features)
    raw, model.model.embed_tokens.weight.data = random_k_blocks(300, 256, GGMLQuantizationType.Q4_K, 99, (5e-5, 3e-4))
    quantized["model.embed_tokens.weight"] = QuantizedWeight(raw, int(GGMLQuantizationType.Q4_K), 256)
    requests = [GenerationRequest(prompt_ids(i, 9 + 13 * i), 8, ignore_eos=True, logprobs=0) for i in range(3)]
    engine = make_engine(model, frozenset({7}), quantized=quantized)
    assert isinstance(engine._runner.embed, PackedWeight)
    assert (engine._runner._layer_op is None) == mixed
    assert isinstance(engine._runner.layers[0].qkv, PackedParts if mixed else PackedWeight)
    together = run_outputs(engine, [(0, r) for r in requests])
    dense = run_outputs(make_engine(model, frozenset({7})), [(0, r) for r in requests])
    for index, request in enumerate(requests):
        alone = run_outputs(make_engine(model, frozenset({7}), quantized=quantized), [(0, request)])[0]
        assert alone == together[index]
        got, want = together[index][0], dense[index][0]
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) < 0.05


def test_a_layer_in_one_native_call_is_bitwise_the_op_by_op_path(tiny_llama_dir) -> None:
    """``llama_layer`` (csrc/llama_layer.cpp) calls the ops the Python runner calls, in the same order."""
    from engine_helpers import make_engine, prompt_ids, run_outputs
    from transformers import AutoModelForCausalLM

    from engine.core.types import GenerationRequest

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    quantized = quantize_model(model, "Q4_0")
    requests = [(i, GenerationRequest(prompt_ids(i, 5 + 21 * i), 10, ignore_eos=True, logprobs=2)) for i in range(4)]
    fused = make_engine(model, frozenset({7}), quantized=quantized, max_num_batched_tokens=24)
    assert fused._runner._layer_op is not None
    op_by_op = make_engine(model, frozenset({7}), quantized=quantized, max_num_batched_tokens=24)
    op_by_op._runner._layer_op = None
    assert run_outputs(fused, requests) == run_outputs(op_by_op, requests)


@pytest.mark.real_model
def test_the_default_gguf_s_blocks_are_the_loaded_model_s_weights(real_model) -> None:
    """Read back from the file, each quantized matrix dequantizes to exactly the weight transformers loaded (the
    query and key rows put back in its order)."""
    from engine.runtime import gguf_weights

    config = real_model.model.config
    weights = gguf_weights.read(real_model.gguf, config.num_attention_heads, config.num_key_value_heads)
    assert len(weights) == 30 * 7 + 2  # every projection, the embedding and the tied output
    parameters = dict(real_model.model.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "lm_head.weight"):  # fmt: skip
        weight = weights[name]
        qtype = GGMLQuantizationType(weight.qtype)
        restored = torch.from_numpy(dequantize(weight.data.numpy(), qtype).copy())
        loaded = parameters.get(name, parameters["model.embed_tokens.weight"])
        assert torch.equal(restored, loaded.detach().float()), name
    # The embedding is looked up in its Q8_0 blocks row by row: the same rows transformers dequantized.
    tokens = torch.tensor([0, 17, 49151, 17])
    embedding = parameters["model.embed_tokens.weight"].detach()
    packed = weights["model.embed_tokens.weight"].pack()
    assert torch.equal(packed.rows(tokens, torch.float32), embedding[tokens])


@pytest.mark.real_model
def test_the_default_model_on_its_blocks_scores_text_as_its_dequantized_weights_do(real_model) -> None:
    """`--quantization auto` (the default) against `none` on the default model: every token of a text scored
    within a small logprob tolerance, and the perplexities close."""
    import math

    from engine_helpers import make_engine

    from engine.core.types import GenerationRequest
    from engine.runtime import gguf_weights

    config = real_model.model.config
    blocks = gguf_weights.read(real_model.gguf, config.num_attention_heads, config.num_key_value_heads)
    text = (
        "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital of "
        "Germany. def add(a, b):\n    return a + b\n\nWater boils at one hundred degrees Celsius at sea level."
    )
    prompt = tuple(real_model.tokenizer.encode(text))
    scored = []
    for quantized in (blocks, None):
        engine = make_engine(real_model.model, real_model.eos_token_ids, quantized=quantized, capacity=2)
        engine.admit([GenerationRequest(prompt, 1, prompt_logprobs=0)])
        outputs = [out for _ in range(8) if engine.num_active() for out in engine.step()]
        scored.append([entry.logprob for entry in outputs[0].prompt_logprobs[1:]])
    native, dense = (torch.tensor(values) for values in scored)
    assert len(native) == len(prompt) - 1
    # Measured: mean 0.07, largest 0.42, perplexity -2.8% on these ~60 tokens (+0.23% over 16K in bench/); a wrong
    # block or scale moves logprobs by whole units.
    assert (native - dense).abs().mean() < 0.12 and (native - dense).abs().max() < 1.0
    assert abs(math.exp(-native.mean()) / math.exp(-dense.mean()) - 1) < 0.05
