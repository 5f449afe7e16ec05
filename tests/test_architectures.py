"""Each natively served architecture (``engine/core/architectures.py``), from a tiny GGUF file written as llama.cpp's
converter writes it (``tests/gguf_files.py``), loaded as `make serve` loads a file (its blocks, no dense copy) and
run by the engine: its prompt scored as transformers' implementation scores the same weights, its greedy tokens and
logprobs the same alone or in a batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_files import tiny_model, write_gguf

from engine.core.architectures import ARCHITECTURES
from engine.core.types import GenerationRequest

#: A Q4_K_M-like mix of the types gguf-py can write, as llama-quantize mixes them.
MIXED = {
    "attn_q": T.Q5_0,
    "attn_k": T.Q5_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q5_1,
    "ffn_gate": T.Q4_0,
    "ffn_up": T.Q4_0,
    "ffn_down": T.Q4_1,
    "token_embd": T.Q5_0,
    "output": T.Q8_0,
    "attn_qkv": T.Q5_0,
    "ffn_gate_exps": T.Q4_0,
    "ffn_up_exps": T.Q4_0,
    "ffn_down_exps": T.Q4_1,
    "in_proj": T.Q5_0,
    "out_proj": T.Q8_0,
    "attn_gate": T.Q8_0,
    "ssm_out": T.Q5_0,
    "ssm_in": T.Q8_0,
    "per_layer_token_embd": T.Q5_0,
    "per_layer_model_proj": T.Q8_0,
    "inp_gate": T.Q8_0,
    "proj": T.Q5_0,
    "ssm_ba": T.Q8_0,
}  # fmt: skip  (phi3: fused q, k and v; qwen3moe: each expert's matrices, the router F32 as llama.cpp keeps it)
#   (lfm2: its short convolutions' input and output projections; gemma4: its per-layer inputs' table and matrices)
#: The architectures of dense MLPs (the start-up probe's and the one-call layer's).
DENSE = [arch for arch, row in ARCHITECTURES.items() if not row.experts]
TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n Ünïcödé ✓ 日本語 🙂"


@pytest.fixture(scope="module")
def tokenizer_file() -> Path:
    from engine.runtime import loader

    return loader._default_gguf()


@pytest.fixture(scope="module")
def served(tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """``served(arch, mix)``: the tiny model of ``arch`` and its GGUF as loaded (once each)."""
    root = tmp_path_factory.mktemp("architectures")
    made: dict[tuple[str, str], tuple] = {}

    def get(arch: str, mix: str) -> tuple:
        if (arch, mix) not in made:
            path = root / f"{arch}-{mix}.gguf"
            types = MIXED if mix == "mixed" else {kind: T[mix] for kind in MIXED} if mix != "F32" else {}
            if arch == "gpt-oss" and mix == "mixed":  # its experts as released: MXFP4
                types = {**types, **dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), T.MXFP4)}
            model = write_gguf(tiny_model(arch, vocab=49152), arch, path, tokenizer_file, types)
            made[arch, mix] = model, load(path, root / "cache")
        return made[arch, mix]

    return get


def load(path: Path, cache: Path):
    from engine.runtime import loader

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(cache))
        return loader.load(str(path), "float32", blocks=True)


def scored(model, eos, quantized, prompt: tuple[int, ...]) -> torch.Tensor:
    from engine_helpers import make_engine

    engine = make_engine(model, eos, quantized=quantized, capacity=2)
    engine.admit([GenerationRequest(prompt, 1, prompt_logprobs=0)])
    outputs = [out for _ in range(8) if engine.num_active() for out in engine.step()]
    return torch.tensor([entry.logprob for entry in outputs[0].prompt_logprobs[1:]])


def reference(model, prompt: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("mix", ["F32", "mixed"])
def test_a_tiny_gguf_scores_text_as_transformers_does(arch: str, mix: str, served) -> None:
    """F32: the same float32 model, equal to rounding. Mixed types: the file's blocks in the native kernels against
    transformers on their dequantized values: only the activations' 8-bit rounding between them."""
    model, loaded = served(arch, mix)
    assert type(loaded.model).__name__ == type(model).__name__
    assert bool(loaded.blocks) == (mix != "F32")
    prompt = tuple(loaded.tokenizer.encode(TEXT))
    got, want = scored(loaded.model, loaded.eos_token_ids, loaded.blocks, prompt), reference(model, prompt)
    assert len(got) == len(prompt) - 1
    if mix == "F32":
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    else:  # measured: mean 0.001-0.02, largest < 0.06; a wrong block, bias, norm or rotation moves whole units
        # gemma3: six layers, each block's output normalized (the activations' rounding scaled up with it): mean
        # 0.11-0.15, largest 0.43-0.73, as much with Q8_0 weights as with this mix (two prompts measured); its
        # window ignored or one RoPE base for both kinds of layer: means of 1.3 and 0.9
        # A mixture of experts: the rounding also flips a near tie of the router's top 2 at a few positions (another
        # expert's output): qwen3moe mean 0.043-0.046, largest 0.42-0.78 over two seeds (Q8_0 weights: 0.012-0.013,
        # 0.03-0.06); olmoe 0.020, 0.24
        # lfm2: four layers whose short convolutions multiply two projections of the rounded input (C * conv(B * x)):
        # mean 0.020-0.029, largest 0.07-0.14 with Q8_0 weights (the activations' rounding alone), 0.030 and 0.10
        # with this mix, over two seeds
        experts = ARCHITECTURES[arch].experts
        # gemma4: gemma3's norms, and each layer's per-layer input through one more pair of products: mean 0.096,
        # largest 0.32 (one seed)
        mean, largest = (0.3, 1.5) if arch in ("gemma3", "gemma4") else (0.06, 1.2) if experts else (0.03, 0.1)
        mean, largest = (0.05, 0.3) if arch == "lfm2" else (mean, largest)
        # qwen35: three gated delta rule layers (L2-normalized queries and keys of the rounded input, a sigmoid and a
        # SiLU gate each): mean 0.070-0.088, largest 0.33-0.53 with Q8_0 weights (the activations' rounding alone),
        # 0.049-0.058 and 0.17-0.20 with this mix, two seeds; the same file served dense: 3e-6
        mean, largest = (0.12, 0.8) if arch == "qwen35" else (mean, largest)
        # qwen35moe: those layers' rounding, and the router's choices it moves: mean 0.19-0.36, largest 0.82-1.36 with
        # this mix, 0.20-0.46 and 1.0-1.9 with Q8_0 weights, two seeds; with every expert chosen (no choice to move)
        # 0.14-0.21; its experts alone in Q8_0 0.049; the same file served dense (its blocks dequantized): 1e-5
        mean, largest = (0.3, 1.5) if arch == "qwen35moe" else (mean, largest)
        # qwen3next: qwen35moe's model, its beta and alpha rows in Q8_0 too (one tensor: qwen35moe's two are F32 in
        # this mix): mean 0.27, largest 2.5, a few more of the router's near ties flipped (its F32 file: to 2e-4)
        mean, largest = (0.4, 3.0) if arch == "qwen3next" else (mean, largest)
        assert (got - want).abs().mean() < mean and (got - want).abs().max() < largest


@pytest.mark.parametrize("mix", ["F32", "mixed"])
def test_granite_4_h_s_mixture_beside_its_mlp_scores_text_as_transformers_does(
    mix: str, tokenizer_file: Path, tmp_path: Path
) -> None:
    """Granite 4.0-H Tiny's and Small's MLP: a mixture of experts (the top k logits' softmax) beside the MLP, which
    joins it without a gate (the file's ``ffn_*_shexp``); one architecture row serves both it and the dense sizes.
    Its mixed-type file as the mixtures' (its MLP in blocks too); greedy the same alone and in a batch."""
    from engine_helpers import make_engine, run_staggered

    path = tmp_path / f"granitehybrid-moe-{mix}.gguf"
    shared = {"ffn_gate_shexp": T.Q4_0, "ffn_up_shexp": T.Q4_0, "ffn_down_shexp": T.Q4_1}
    types = {**MIXED, **shared} if mix == "mixed" else {}
    model = write_gguf(tiny_model("granitehybrid", vocab=49152, mixture=True), "granitehybrid", path, tokenizer_file,
                       types)  # fmt: skip
    loaded = load(path, tmp_path / "cache")
    assert loaded.model.config.num_local_experts == 8 and ARCHITECTURES["granitehybrid"].mixture(loaded.model.config)
    prompt = tuple(loaded.tokenizer.encode(TEXT))
    got, want = scored(loaded.model, loaded.eos_token_ids, loaded.blocks, prompt), reference(model, prompt)
    if mix == "F32":
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    else:  # as the other mixtures: the activations' rounding, and the router's near ties it flips
        assert (got - want).abs().mean() < 0.06 and (got - want).abs().max() < 1.2
    requests = [GenerationRequest(prompt[: 5 + 3 * i], 12, ignore_eos=True) for i in range(4)]
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
    together = run_staggered(engine, [(0, request) for request in requests])
    for index, request in enumerate(requests):
        alone = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
        assert run_staggered(alone, [(0, request)])[0] == together[index]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_the_file_s_vocabulary_tokenizes_as_the_file_it_came_from(arch: str, served, tokenizer_file: Path) -> None:
    """Every tiny file holds the bundled model's byte-level vocabulary: each tokenizes as that file does. transformers
    reloads a gemma3 file's tokenizer as GemmaTokenizer, whose SentencePiece pipeline split every word into bytes."""
    from transformers import AutoTokenizer

    _, loaded = served(arch, "F32")
    bundled = AutoTokenizer.from_pretrained(tokenizer_file.parent, gguf_file=tokenizer_file.name)
    assert loaded.tokenizer.encode(TEXT) == bundled.encode(TEXT)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_long_context_rope_is_read_from_the_file_s_frequency_factors(
    arch: str, tokenizer_file: Path, tmp_path: Path
) -> None:
    """Llama 3.1+ files carry their RoPE scaling as ``rope_freqs.weight``, Phi-3.5's LongRoPE as
    ``rope_factors_long``/``_short`` and an attention factor: without them every rotation but the fastest ones is
    off, and the scores move by whole units. Past the pretraining context (64 positions here) both sides rotate by
    the long factors (the server decides by its context size, as llama.cpp does; transformers by the sequence's)."""
    model = tiny_model(arch, vocab=49152, long_rope=True)
    path = tmp_path / f"{arch}-long.gguf"
    write_gguf(model, arch, path, tokenizer_file, {})
    loaded = load(path, tmp_path / "cache")
    prompt = tuple(loaded.tokenizer.encode(TEXT * 3))  # past the 64 positions of the scaling's original context
    got, want = scored(loaded.model, loaded.eos_token_ids, None, prompt), reference(model, prompt)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("arch", DENSE)
def test_the_start_up_probe_times_both_paths_of_every_architecture(arch: str, served) -> None:
    """What `make serve` runs before serving: both paths' products of the first layer (the output projection takes
    the heads side by side: wider than the hidden size for qwen3, whose probe first fed it the hidden size)."""
    from engine.runtime import gguf_model
    from engine.runtime.path_probe import probe, probed

    _, loaded = served(arch, "mixed")
    gguf_model.densify(loaded.model, loaded.blocks, [n for n in loaded.blocks if n.startswith(probed(loaded.model))])
    times = probe(loaded.model, loaded.blocks, 8, repeats=1)
    assert times.quantized and times.rows[-1] == 8 and all(t > 0 for t in times.invariant + times.dense)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_output_is_the_same_alone_and_in_a_batch(arch: str, served) -> None:
    from engine_helpers import make_engine, run_outputs

    _, loaded = served(arch, "mixed")
    requests = [
        GenerationRequest(tuple(range(100 + i, 120 + 17 * i)), 10, ignore_eos=True, logprobs=2) for i in range(4)
    ]
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
    together = run_outputs(engine, [(i, r) for i, r in enumerate(requests)])  # staggered arrivals
    for index, request in enumerate(requests):
        alone = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
        assert run_outputs(alone, [(0, request)])[0] == together[index]


@pytest.mark.parametrize(
    "arch", [arch for arch in DENSE if not (ARCHITECTURES[arch].gated_attention or ARCHITECTURES[arch].value_norm)]
)
def test_each_layer_in_one_native_call_is_bitwise_the_op_by_op_path(arch: str, served) -> None:
    """``csrc/llama_layer.cpp`` does what each architecture adds (biases, head norms, output norms, GELU, a sliding
    window) with the ops the Python runner calls, in the same order. (Qwen3.5's gated attention, turning a quarter
    of each head, and Gemma 4's layers run op by op.)"""
    from engine_helpers import make_engine, run_outputs

    _, loaded = served(arch, "Q8_0")  # one type: each layer's projections stacked into one matrix each
    requests = [(i, GenerationRequest(tuple(range(50 + i, 60 + 21 * i)), 6, ignore_eos=True, logprobs=2))
                for i in range(3)]  # fmt: skip
    fused = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=24)
    assert fused._runner._layer_op is not None
    assert fused._facts["weights"].startswith(f"{arch}, GGUF blocks Q8_0 (native kernels)")  # as the file names it
    op_by_op = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=24)
    op_by_op._runner._layer_op = None
    assert run_outputs(fused, requests) == run_outputs(op_by_op, requests)


@pytest.mark.parametrize("arch", [arch for arch, row in ARCHITECTURES.items() if row.experts])
@pytest.mark.parametrize("mix", ["Q8_0", "mixed"])
def test_a_mixture_s_experts_in_one_native_call_are_bitwise_the_python_loop(arch: str, mix: str, served) -> None:
    """``csrc/experts.cpp`` takes each chosen expert's rows, blocks and weights as ``_mixture``'s loop does, in the
    same order (gpt-oss: its biases and clamped SwiGLU too): the same tokens and log-probabilities, with several rows
    a step choosing overlapping experts."""
    from engine_helpers import make_engine, run_outputs

    _, loaded = served(arch, mix)
    requests = [(i, GenerationRequest(tuple(range(50 + i, 60 + 21 * i)), 6, ignore_eos=True, logprobs=2))
                for i in range(3)]  # fmt: skip
    native = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=24)
    mixtures = [layer.experts for layer in native._runner.layers if layer.experts is not None]
    assert mixtures and all(m.stacked is not None for m in mixtures) and native._runner._moe is not None
    looped = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=24)
    looped._runner._moe = None
    assert run_outputs(native, requests) == run_outputs(looped, requests)


def test_gemma3_s_sliding_window_in_torch_s_attention_too(served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native kernels (no compiler), the torch fallback masks each local layer's window: prompt rows in
    chunks and decode rows alike."""
    from engine_helpers import make_engine, run_staggered
    from engine_helpers import reference as generated

    from engine.runtime import kernels

    model, loaded = served("gemma3", "F32")
    monkeypatch.setenv("SMOLSERVE_NATIVE_KERNELS", "0")
    kernels.native_ops.cache_clear()
    try:
        prompt = tuple(loaded.tokenizer.encode(TEXT))
        got, want = scored(loaded.model, loaded.eos_token_ids, None, prompt), reference(model, prompt)
        request = GenerationRequest(prompt[:20], 12, ignore_eos=True)
        engine = make_engine(loaded.model, loaded.eos_token_ids, max_num_batched_tokens=16)  # two prompt chunks
        assert engine._runner._layer_op is None and not engine.cache.native_decode
        tokens = run_staggered(engine, [(0, request)])[0]
    finally:
        monkeypatch.undo()
        kernels.native_ops.cache_clear()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert tokens == generated(model, request)  # transformers' own generate, with its sliding-window cache


def other_architecture(tokenizer_file: Path, tmp_path: Path) -> Path:
    """A tiny llama file whose ``general.architecture`` (the file's first "llama") reads "xllam"."""
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_model("llama", vocab=49152), "llama", path, tokenizer_file, {})
    renamed = tmp_path / "other-arch.gguf"
    renamed.write_bytes(path.read_bytes().replace(b"llama", b"xllam", 1))
    return renamed


def test_an_architecture_not_served_natively_is_refused_naming_those_that_are(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    from engine.core.architectures import NotServedNatively

    renamed = other_architecture(tokenizer_file, tmp_path)
    served = (
        "llama, qwen2, qwen3, qwen3moe, qwen2moe, olmoe, gpt-oss, granite, smollm3, granitemoe, phi3, qwen35, "
        "qwen35moe, qwen3next, lfm2, granitehybrid, gemma3, gemma4"
    )
    with pytest.raises(NotServedNatively, match=rf"'xllam' is not served natively .*{served}"):
        load(renamed, tmp_path / "cache")


@pytest.mark.parametrize(("renamed", "error"), [
    ("blk.1.post_ffw_norm.weight", r"llama file's tensor blk.1.post_ffw_norm.weight is not read by the native path"),
    (None, r"this llama file has no tensor for model.layers.1.post_attention_layernorm.weight"),
    ("blk.1.ffn_gate_shexp.weight",  # a shared expert's, in a family without one (GraniteMoeShared's in granitemoe)
     r"this llama file's model.layers.1.mlp.shared_expert.gate_proj.weight has no place in transformers' llama"),
])  # fmt: skip
def test_a_tensor_the_path_does_not_read_or_a_weight_the_file_lacks_is_refused(
    renamed: str | None, error: str, tokenizer_file: Path, tmp_path: Path
) -> None:
    """A file whose tensor names the path does not know (another converter's, a variant's) fails at start naming
    the tensor, never serves memory nothing wrote (Gemma 3's output norms went unread this way, under names the
    converter does not use)."""
    import gguf

    from engine.core.architectures import NotServedNatively

    add_tensor = gguf.GGUFWriter.add_tensor

    def add(self, name, tensor, raw_shape=None, raw_dtype=None):  # type: ignore[no-untyped-def]
        if name == "blk.1.ffn_norm.weight":
            return None if renamed is None else add_tensor(self, renamed, tensor, raw_shape, raw_dtype)
        return add_tensor(self, name, tensor, raw_shape, raw_dtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", add)
        write_gguf(tiny_model("llama", vocab=49152), "llama", tmp_path / "odd.gguf", tokenizer_file, {})
    with pytest.raises(NotServedNatively, match=error):
        load(tmp_path / "odd.gguf", tmp_path / "cache")


def test_a_phi3_file_that_rotates_part_of_each_head_is_refused(tokenizer_file: Path, tmp_path: Path) -> None:
    """Phi-4-mini rotates 3/4 of each head's dims: the native RoPE turns whole heads, so the file is refused by name
    rather than served wrong."""
    import gguf

    from engine.core.architectures import NotServedNatively

    add = gguf.GGUFWriter.add_rope_dimension_count
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", lambda self, n: add(self, n * 3 // 4))
        write_gguf(tiny_model("phi3", vocab=49152), "phi3", tmp_path / "partial.gguf", tokenizer_file, {})
    with pytest.raises(NotServedNatively, match=r"rotates 24 of each head's 32 dims \(partial RoPE\)"):
        load(tmp_path / "partial.gguf", tmp_path / "cache")


def test_gemma3_s_window_pattern_is_read_from_the_file_where_it_is_given(tokenizer_file: Path) -> None:
    """A file may list which layers slide (``gemma3.attention.sliding_window_pattern``, an array of flags, as
    llama.cpp reads it); absent, every sixth layer is global."""
    from types import SimpleNamespace

    from engine.runtime.gguf_config import _gemma3, _local_layers

    keys = {"general.architecture": "gemma3", "gemma3.block_count": 4, "gemma3.attention.sliding_window": 512}
    got = _local_layers(SimpleNamespace(keys=keys))  # type: ignore[arg-type]
    assert got["layer_types"] == ["sliding_attention"] * 4
    values = {"hidden_size": 640, "num_attention_heads": 4, "head_dim": 256, "num_hidden_layers": 4}
    assert _gemma3(SimpleNamespace(keys=keys), {}, values)["query_pre_attn_scalar"] == 256  # type: ignore[arg-type]
    keys["gemma3.attention.sliding_window_pattern"] = [True, False, True, False]
    got = _local_layers(SimpleNamespace(keys=keys))  # type: ignore[arg-type]
    assert got["layer_types"] == ["sliding_attention", "full_attention"] * 2 and got["sliding_window"] == 512


def test_gpt_oss_s_windows_and_yarn_are_read_as_llama_cpp_reads_them() -> None:
    """gpt-oss's file gives no pattern: every other layer slides, from the first (llama.cpp's period of 2); its
    YaRN keys become transformers' (the correction range truncated, as ggml computes it), one table for both
    kinds of layer."""
    from types import SimpleNamespace

    from engine.runtime.gguf_config import _local_layers, _rope

    keys = {"general.architecture": "gpt-oss", "gpt-oss.block_count": 4, "gpt-oss.attention.sliding_window": 128,
            "gpt-oss.rope.freq_base": 150000.0, "gpt-oss.rope.scaling.type": "yarn",
            "gpt-oss.rope.scaling.factor": 32.0, "gpt-oss.rope.scaling.original_context_length": 4096}  # fmt: skip
    got = _local_layers(SimpleNamespace(keys=keys))  # type: ignore[arg-type]
    assert got == {"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2}
    rope = _rope(SimpleNamespace(keys=keys))  # type: ignore[arg-type]
    assert rope == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                    "original_max_position_embeddings": 4096}  # fmt: skip


def test_a_tensor_type_the_kernels_do_not_read_is_refused_naming_those_they_do(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    """An IQ2_XXS matrix (a type outside the list): refused at start, not dequantized into a silent dense path."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES

    from engine.core.architectures import NotServedNatively

    path = tmp_path / "iq2.gguf"
    model = tiny_model("llama", vocab=49152)
    import gguf

    add_tensor = gguf.GGUFWriter.add_tensor

    def add(self, name, tensor, raw_shape=None, raw_dtype=None):  # type: ignore[no-untyped-def]
        if name == "blk.0.ffn_down.weight":  # 256 inputs: one IQ2_XXS block a row
            weights, size = GGML_QUANT_SIZES[T.IQ2_XXS]
            rows, cols = tensor.shape
            raw = np.random.default_rng(0).integers(0, 256, (rows, cols // weights * size), dtype=np.uint8)
            return add_tensor(self, name, raw, raw_dtype=T.IQ2_XXS)
        return add_tensor(self, name, tensor, raw_shape, raw_dtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", add)
        write_gguf(model, "llama", path, tokenizer_file, {})
    with pytest.raises(NotServedNatively, match=r"IQ2_XXS is not read by the native kernels \(read: Q4_0, "):
        load(path, tmp_path / "cache")


def test_python_m_app_refuses_such_a_file_with_its_message_and_no_traceback(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    """What a user sees: one line naming the file, what it holds and what is served; a non-zero exit."""
    import os
    import subprocess
    import sys

    renamed = other_architecture(tokenizer_file, tmp_path)
    env = {**os.environ, "SMOLSERVE_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "app", "--model", str(renamed), "--embedding-model", "none", "--port", "1"],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot serve {renamed}: GGUF architecture 'xllam' is not served natively" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("arch", [arch for arch, row in ARCHITECTURES.items() if row.experts])
def test_a_mixture_served_dense_scores_as_transformers_does(arch: str, served, tmp_path: Path) -> None:
    """``--quantization none`` of a mixture's file: its blocks dequantized into transformers' model (each expert into
    its rows of the 3-D parameters; transformers' own reading of these files failed with a traceback), then the
    float32 forward: transformers' scores on the file's values, to rounding."""
    from engine.runtime import loader

    model, loaded = served(arch, "mixed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(tmp_path))
        dense = loader.load(str(loaded.gguf), "float32")
    assert dense.blocks is None
    prompt = tuple(dense.tokenizer.encode(TEXT))
    got, want = scored(dense.model, dense.eos_token_ids, None, prompt), reference(model, prompt)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_a_file_s_description_is_found_again_by_its_keys_not_its_weights(tokenizer_file: Path, tmp_path: Path) -> None:
    """The config and tokenizer made from a file's keys are cached by the bytes they come from (keys and tensor
    infos), so a start never reads the tensors' data to find them (a 30B-A3B's 18.6 GB were hashed every start):
    other weights under the same keys find the same description, another key a new one."""
    from engine.runtime import loader

    paths = {}
    for name, seed, positions in (("a", 0, 1024), ("b", 1, 1024), ("c", 0, 2048)):
        (tmp_path / name).mkdir()
        paths[name] = tmp_path / name / "llama.gguf"
        write_gguf(tiny_model("llama", vocab=49152, seed=seed, positions=positions), "llama", paths[name],
                   tokenizer_file, {})  # fmt: skip
    assert paths["a"].read_bytes() != paths["b"].read_bytes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(tmp_path / "cache"))
        found = {name: loader._described(path) for name, path in paths.items()}
    assert found["a"] == found["b"] != found["c"]
    assert '"max_position_embeddings": 2048' in (found["c"] / "config.json").read_text()
