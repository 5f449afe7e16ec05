"""The native matmul on GGUF quantized weights (Q4_0, Q4_1, Q8_0) against dequantize-then-matmul, its portable
loops against its AVX2 path, and rows computed alike whatever shares their call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType, dequantize, quantize

from engine import kernels
from engine.gguf_weights import QuantizedWeight

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def quantized_weight(out: int, inp: int, qtype: GGMLQuantizationType, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights in ``qtype``'s blocks (GGML's bytes, [out, bytes]) and their dequantized float32 values."""
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((out, inp)).astype(np.float32), qtype)
    return torch.from_numpy(raw.copy()), torch.from_numpy(dequantize(raw, qtype).copy())


def ops():
    native = kernels.native_ops()
    assert native is not None
    return native


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantize_then_matmul(qtype: GGMLQuantizationType, rows: int, dtype: torch.dtype) -> None:
    """What is left is the activations' 8-bit rounding per block of 32: about 1% of an output's typical size."""
    weight, dense = quantized_weight(67, 96, qtype, seed=rows)  # an odd number of outputs; three blocks a row
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = ops().quant_linear(x, weight, int(qtype))
    assert got.dtype == dtype and got.shape == (rows, 67)
    want = x.float() @ dense.T
    scale = want.abs().mean()
    assert (got.float() - want).abs().max() <= 0.03 * scale + (0.02 * scale if dtype == torch.bfloat16 else 0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_portable_loops_agree_with_the_native_path(qtype: GGMLQuantizationType) -> None:
    weight, _ = quantized_weight(40, 64, qtype, seed=7)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    native, portable = ops().quant_linear(x, weight, int(qtype)), ops().quant_linear(x, weight, int(qtype), True)
    torch.testing.assert_close(native, portable, atol=1e-4, rtol=1e-5)  # the same integers, summed in another order


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_comes_out_the_same_whatever_shares_its_call(qtype: GGMLQuantizationType) -> None:
    weight, _ = quantized_weight(50, 64, qtype, seed=3)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(3))
    together = ops().quant_linear(x, weight, int(qtype))
    for row in range(11):
        assert torch.equal(ops().quant_linear(x[row : row + 1], weight, int(qtype))[0], together[row])


def test_refuses_what_it_cannot_read() -> None:
    weight, _ = quantized_weight(4, 64, GGMLQuantizationType.Q4_1, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops().quant_linear(torch.zeros(1, 40), weight, int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops().quant_linear(torch.zeros(1, 64), weight, int(GGMLQuantizationType.Q8_0))
    with pytest.raises(RuntimeError, match="unsupported quantized type"):
        ops().quant_linear(torch.zeros(1, 64), weight, 12)


# -- served: a llama's matrices in their GGUF blocks -------------------------------------------------------


def quantize_model(model: torch.nn.Module, qtype: GGMLQuantizationType) -> dict[str, QuantizedWeight]:
    """Each linear of a llama quantized to ``qtype`` (its dense weight replaced by the dequantized values, so both
    paths hold the same weights); by transformers' name, as ``gguf_weights.read`` gives them."""
    quantized = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight.shape[1] % 32 == 0:
            raw = quantize(module.weight.detach().numpy(), qtype)
            module.weight.data = torch.from_numpy(dequantize(raw, qtype).copy())
            quantized[f"{name}.weight"] = QuantizedWeight(torch.from_numpy(raw.copy()), int(qtype), module.in_features)
    return quantized


def test_an_engine_on_quantized_blocks_matches_the_dequantized_one_and_stays_batch_invariant(tiny_llama_dir) -> None:
    from engine_helpers import make_engine, prompt_ids, run_outputs
    from transformers import AutoModelForCausalLM

    from engine.types import GenerationRequest

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    quantized = quantize_model(model, GGMLQuantizationType.Q8_0)
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


@pytest.mark.real_model
def test_the_default_gguf_s_blocks_are_the_loaded_model_s_weights(real_model) -> None:
    """Read back from the file, each quantized matrix dequantizes to exactly the weight transformers loaded (the
    query and key rows put back in its order)."""
    from engine import gguf_weights

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
    assert torch.equal(weights["model.embed_tokens.weight"].rows(tokens, torch.float32), embedding[tokens])
