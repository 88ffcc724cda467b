"""FP8 matrix products of the dense layers (`gemm_dtype: fp8`): weights and activations in
float8_e4m3fn, products on Hopper's FP8 tensor cores.

The scheme is W8A8 with dynamic activation scales, as vLLM's "fp8 dynamic" runs it:

- a weight is quantized once, at load, with one fp32 scale per output channel (row), so rows
  concatenated (the engine fuses q/k/v and gate/up) keep their scales: a fused weight is exactly
  the separate ones quantized, and a row of zeros (the vision MLP's padding) stays zeros;
- an activation is quantized at each call with one scale per token (row), so a token's product
  does not depend on the batch it came in: streamed and one-shot inference quantize alike.

`fp8_linear` is the one product: on a GPU with FP8 tensor cores `torch._scaled_mm` with row-wise
scales (fp32 accumulation, scales and bias applied in its epilogue, bf16 out); elsewhere, and
for a weight whose sides are not multiples of 16 (what `_scaled_mm` takes), an emulation of the
same quantization: the same fp8 values multiplied in fp32, then scaled. `quantize_model` swaps
transformers' Linear modules for `FP8Linear`, which calls it too, so one-shot inference
(offline.py, the oracle) computes with the same quantization as the engine.

What is quantized: the language model's q/k/v/o projections and MLP, the vision blocks' qkv and
output projections and MLP. The embedding, lm_head, norms, attention, the vision patch embedding
and merger stay in the model's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import structlog
import torch
import torch.nn.functional as F
from torch import nn

log = structlog.get_logger()

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_AMAX = 1e-12  # a row of zeros gets this as its largest value: scale > 0, its fp8 values 0
ZERO_ROW_SCALE = float(torch.tensor(MIN_AMAX) / FP8_MAX)  # that row's scale, as quantize_rows makes it (fp32)
SCALED_MM_ALIGN = 16  # _scaled_mm needs K and N multiples of this (M any)
SCALED_MM_OUT = (torch.bfloat16, torch.float16)  # its bias must be of the output's dtype, not fp32
GEMM_DTYPES = ("bf16", "fp8")


class FP8Weight(NamedTuple):
    """A quantized (N, K) weight: `data` float8_e4m3fn (N, K) row-major, `scale` (N,) fp32, so that
    weight ~ data * scale[:, None]. `native`: its products go through `_scaled_mm`."""

    data: torch.Tensor
    scale: torch.Tensor
    native: bool

    @classmethod
    def of(cls, data: torch.Tensor, scale: torch.Tensor) -> FP8Weight:
        return cls(data, scale, _scaled_mm_takes(data))


Weight = torch.Tensor | FP8Weight  # what the engine's products take: a plain weight or a quantized one


def _scaled_mm_takes(data: torch.Tensor) -> bool:
    """Whether `_scaled_mm` multiplies by this (N, K) weight: a GPU with FP8 tensor cores (compute
    capability 8.9 or more) and both sides multiples of 16."""
    if data.device.type != "cuda" or torch.cuda.get_device_capability(data.device) < (8, 9):
        return False
    return all(side % SCALED_MM_ALIGN == 0 for side in data.shape)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> fp8 (M, K) and its fp32 scales (M, 1): each row scaled so its largest |value| is
    FP8_MAX, rounded to nearest. Weights (per output channel) and activations (per token) alike."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(weight: torch.Tensor) -> FP8Weight:
    data, scale = quantize_rows(weight.detach())
    return FP8Weight.of(data, scale[:, 0])


def fp8_linear(x: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with x quantized per token and `w` quantized: (..., K) -> (..., N)
    in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, x_scale = quantize_rows(x.reshape(-1, k))
    if w.native and x.dtype in SCALED_MM_OUT:
        out = torch._scaled_mm(
            xq, w.data.t(), scale_a=x_scale, scale_b=w.scale.view(1, -1), bias=bias, out_dtype=x.dtype
        )
    else:
        out = emulated_mm(xq, x_scale, w, bias).to(x.dtype)
    return out.view(*lead, -1)


def emulated_mm(xq: torch.Tensor, x_scale: torch.Tensor, w: FP8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """What `_scaled_mm` computes, in fp32: the fp8 values' products summed (each exact in fp32),
    then both scales, then the bias (M, N), before the cast to the output's dtype."""
    out = (xq.float() @ w.data.float().t()) * x_scale * w.scale
    return out if bias is None else out + bias.float()


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's dense product: `F.linear` for a plain weight, `fp8_linear` for a quantized one."""
    if isinstance(weight, FP8Weight):
        return fp8_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class FP8Linear(nn.Module):
    """An nn.Linear whose weight is quantized (`qweight`, a plain attribute: no parameter or buffer,
    so the model's dtype and `.to()` are not the fp8 data's)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.qweight = quantize_weight(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.qweight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def quantize_model(model: nn.Module) -> int:
    """Qwen2.5-VL's dense layers (see the module's docstring) made FP8Linear, in place, once the
    model is on its device; -> how many."""
    text, visual = model.model.language_model, model.model.visual
    parents = [m for layer in text.layers for m in (layer.self_attn, layer.mlp)]
    parents += [m for block in visual.blocks for m in (block.attn, block.mlp)]
    swapped = 0
    with torch.no_grad():
        for parent in parents:
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, FP8Linear(child))
                    swapped += 1
    return swapped


# --------------------------------------------------------------------------- weights, either kind


def weight_of(module: nn.Module) -> Weight:
    return module.qweight if isinstance(module, FP8Linear) else module.weight


def set_weight(module: nn.Module, weight: Weight) -> None:
    if isinstance(module, FP8Linear):
        module.qweight = weight
    else:
        module.weight = nn.Parameter(weight, requires_grad=False)


def cat_rows(weights: list[Weight]) -> Weight:
    """Weights stacked along their output channels (one product for several)."""
    if isinstance(weights[0], FP8Weight):
        return FP8Weight.of(torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]))
    return torch.cat(weights)


def row_slice(weight: Weight, start: int, stop: int) -> Weight:
    """Output channels start..stop, a view."""
    if isinstance(weight, FP8Weight):
        return FP8Weight.of(weight.data[start:stop], weight.scale[start:stop])
    return weight[start:stop]


def pad(weight: Weight, rows: int = 0, cols: int = 0) -> Weight:
    """`rows` output channels and `cols` input columns of zeros added: quantized, the zeros are
    what quantizing the padded weight gives (a zero row's scale as for MIN_AMAX; zero columns
    change no row's largest value)."""
    if not isinstance(weight, FP8Weight):
        return F.pad(weight, (0, cols, 0, rows))
    data = F.pad(weight.data.view(torch.uint8), (0, cols, 0, rows)).view(FP8)  # byte 0 is +0.0 in e4m3fn
    return FP8Weight.of(data, F.pad(weight.scale, (0, rows), value=ZERO_ROW_SCALE))


def warn_emulated(where: str, weights: list[Weight], device: torch.device) -> None:
    """One line when some of a GPU model's quantized weights cannot go through `_scaled_mm` (a GPU
    without FP8 tensor cores, a side not a multiple of 16): their products are emulated, slowly."""
    quantized = [w for w in weights if isinstance(w, FP8Weight)]
    emulated = [tuple(w.data.shape) for w in quantized if not w.native]
    if device.type == "cuda" and emulated:
        log.warning("fp8 products emulated", where=where, weights=len(emulated), of=len(quantized), shapes=emulated[:4])
