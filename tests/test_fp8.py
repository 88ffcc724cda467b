"""Oracles for FP8 matrix products (`gemm_dtype: fp8`, common/engine/fp8.py): tiny-random, fp32, CPU.

FP8 is lossy, so it has an oracle of its own: a streamed answer equals one-shot transformers
inference run with the same quantization (greedy tokens equal, first-token logits within
`SAME_QUANTIZATION`), over several appended chunks and right after an exact eviction. The same answers against bf16's
one-shot inference must fail that comparison (the quantization did something), and quantizing
fused or padded weights equals quantizing the weights they are made of. tests/test_gpu.py checks
`torch._scaled_mm` against the emulation these run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.config import ConfigError, load_config
from common.engine.answer import ask
from common.engine.fp8 import FP8Linear, FP8Weight, cat_rows, fp8_linear, quantize_weight
from common.engine.grid import Grid, StreamSpec
from common.engine.model import load_model
from common.engine.offline import offline_answer
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.stream_engine import StreamEngine
from encoder_worker.config import EncoderConfig
from tests.engine_helpers import (
    QUESTION,
    Comparison,
    append_chunk,
    compare_with_offline,
    kept_frames,
    make_frames,
    policy_keeping,
)

GRID = Grid(56, 56)  # 4 tokens per temporal patch (2 frames)
FPS, CHUNK = 2.0, 4
# Two computations of the same quantization agree to about 1e-6 before each product (our forward
# and transformers' differ in the order of their sums), but an activation that lands on an e4m3
# rounding boundary then rounds one step (an eighth of its size) apart, and that moves these
# logits by up to about 0.1 (0.106 in one window with transformers 5.24, 2026-11-28; the other
# windows 2e-6). The quantization itself moves them by over 1 (test_fp8_answers_are_not_bf16s), so
# this bound still tells the same quantization from another one; greedy tokens must be equal too.
SAME_QUANTIZATION = 0.25


def same_quantization(c: Comparison) -> bool:
    return c.tokens_equal and c.max_logit_diff <= SAME_QUANTIZATION


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random", gemm_dtype="fp8"))


@pytest.fixture(scope="module")
def plain() -> Runtime:
    """The same random weights (seeded), unquantized."""
    return Runtime(load_model("tiny-random"))


def assert_same_quantized(got: FP8Weight, want: FP8Weight) -> None:
    assert got.data.dtype == torch.float8_e4m3fn and got.scale.dtype == torch.float32
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)


def test_streamed_answers_equal_one_shot_inference_with_the_same_quantization(rt):
    frames = make_frames(5 * CHUNK, GRID, seed=3)
    engine = StreamEngine(rt, StreamSpec("cam", FPS, GRID, CHUNK))
    compared = []
    for i in range(0, len(frames), CHUNK):
        version = append_chunk(engine, frames, i, CHUNK)
        if i:  # after every chunk from the second
            compared.append(compare_with_offline(rt, version, frames[: i + CHUNK], GRID, FPS))
    assert len(compared) == 4 and all(same_quantization(c) for c in compared), compared


def test_an_answer_right_after_an_exact_eviction_equals_one_shot_on_the_retained_frames(rt):
    policy = policy_keeping(rt, 5 * 2 * CHUNK, 3 * 2 * CHUNK, sink_chunks=1, mode="exact")
    frames = make_frames(10 * CHUNK, GRID, seed=4)
    engine = StreamEngine(rt, StreamSpec("cam", FPS, GRID, CHUNK), policy)
    compared = []
    for i in range(0, len(frames), CHUNK):
        evictions = engine.head.stats.evictions
        version = append_chunk(engine, frames, i, CHUNK)
        if version.stats.evictions > evictions:
            compared.append(compare_with_offline(rt, version, kept_frames(version, frames), GRID, FPS))
    assert len(compared) >= 2 and all(same_quantization(c) for c in compared), compared


def test_fp8_answers_are_not_bf16s(rt, plain):
    """The comparison above fails against one-shot inference without the quantization: the logits
    move by far more than `SAME_QUANTIZATION` (here by 1.8, the largest logit 5.3)."""
    frames = make_frames(4 * CHUNK, GRID, seed=5)
    engine = StreamEngine(rt, StreamSpec("cam", FPS, GRID, CHUNK))
    for i in range(0, len(frames), CHUNK):
        version = append_chunk(engine, frames, i, CHUNK)
    streamed = ask(rt, version, QUESTION, GenerationParams(max_tokens=1), keep_logits=True).first_logits.cpu()
    bf16 = offline_answer(plain, frames, GRID, FPS, QUESTION, max_tokens=1).first_logits
    fp8 = offline_answer(rt, frames, GRID, FPS, QUESTION, max_tokens=1).first_logits
    assert float((streamed - bf16).abs().max()) > 4 * SAME_QUANTIZATION
    assert float((fp8 - bf16).abs().max()) > 4 * SAME_QUANTIZATION
    assert float((streamed - fp8).abs().max()) <= SAME_QUANTIZATION


def test_every_dense_layer_and_only_those_is_quantized_and_held_once(rt, plain):
    model = rt.loaded.model
    quantized = {name for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    text, vision = model.config.text_config, model.config.vision_config
    assert len(quantized) == 7 * text.num_hidden_layers + 5 * vision.depth
    assert all(".layers." in name or ".blocks." in name for name in quantized)  # not the merger, not lm_head
    assert not any(isinstance(m, FP8Linear) for m in plain.loaded.model.modules())
    assert rt.loaded.gemm_dtype == "fp8" and plain.loaded.gemm_dtype == "bf16"
    # transformers' modules read the engine's fused weights: the oracle uses the very same fp8 values
    attn = model.model.language_model.layers[0].self_attn
    assert attn.k_proj.qweight.data.untyped_storage().data_ptr() == rt.lm.weights[0].qkv.data.data_ptr()


def test_fused_qkv_and_gate_up_equal_the_separate_matrices_quantized(rt, plain):
    for fused, layer in zip(rt.lm.weights, plain.loaded.model.model.language_model.layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        parts = [quantize_weight(m.weight) for m in projections]
        assert_same_quantized(fused.qkv, cat_rows(parts))
        assert_same_quantized(fused.qkv, quantize_weight(torch.cat([m.weight for m in projections])))
        assert_same_quantized(fused.gate_up, quantize_weight(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))
        assert_same_quantized(fused.down, quantize_weight(mlp.down_proj.weight))
        # one product for three: each token's q, k and v as their own products give them
        x = torch.randn(7, attn.q_proj.in_features)
        separate = [fp8_linear(x, w, m.bias) for w, m in zip(parts, projections, strict=True)]
        torch.testing.assert_close(fp8_linear(x, fused.qkv, fused.qkv_bias), torch.cat(separate, -1))


def test_the_padded_vision_mlp_equals_the_unpadded_one_quantized(rt, plain):
    """The tower's MLP is padded to a multiple of 128 (zero rows of gate and up, zero columns of
    down): quantized, it is the padded matrices quantized, and its product the module's."""
    block, module = rt.vision_tower.blocks[0], plain.loaded.model.model.visual.blocks[0].mlp
    extra = block.gate_up_weight.data.shape[0] // 2 - module.gate_proj.out_features
    assert extra > 0
    rows = [F.pad(m.weight, (0, 0, 0, extra)) for m in (module.gate_proj, module.up_proj)]
    assert_same_quantized(block.gate_up_weight, quantize_weight(torch.cat(rows)))
    assert_same_quantized(block.down_weight, quantize_weight(F.pad(module.down_proj.weight, (0, extra))))
    quantized = rt.loaded.model.model.visual.blocks[0].mlp
    x = torch.randn(9, module.gate_proj.in_features)
    gate, up = fp8_linear(x, block.gate_up_weight, block.gate_up_bias).chunk(2, -1)
    padded = fp8_linear(F.silu(gate) * up, block.down_weight, block.down_bias)
    torch.testing.assert_close(padded, quantized(x), rtol=1e-5, atol=1e-5)


def test_a_rows_quantization_depends_on_that_row_alone():
    """Per-token activation scales: a token's product is the same in any batch (streamed chunks and
    one-shot inference batch tokens differently), and a row's scale maps its largest |value| to 448."""
    torch.manual_seed(0)
    w = quantize_weight(torch.randn(48, 32))
    x = torch.randn(10, 32) * torch.logspace(-3, 3, 10)[:, None]
    whole = fp8_linear(x, w)
    for i in range(10):
        torch.testing.assert_close(fp8_linear(x[i : i + 1], w), whole[i : i + 1], rtol=1e-6, atol=0)
    assert float(w.data.float().abs().amax(1).min()) == 448.0


def test_gemm_dtype_is_a_setting_of_bf16_or_fp8():
    env = {"SVQA_STREAMS": "cam1"}
    assert load_config(EncoderConfig, [], env=env).gemm_dtype == "bf16"
    assert load_config(EncoderConfig, ["--gemm-dtype", "fp8"], env=env).gemm_dtype == "fp8"
    with pytest.raises(ConfigError, match="gemm-dtype"):
        load_config(EncoderConfig, ["--gemm-dtype", "fp16"], env=env)
    with pytest.raises(ValueError, match="gemm_dtype"):
        load_model("tiny-random", gemm_dtype="int8")


def test_a_service_loads_its_model_with_its_gemm_dtype():
    from common import boot

    assert boot.load_model_or_exit("tiny-random", "cpu", gemm_dtype="fp8").loaded.gemm_dtype == "fp8"
    assert boot.load_model_or_exit("tiny-random", "cpu").loaded.gemm_dtype == "bf16"
