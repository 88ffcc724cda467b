"""Retrieval features: the model's own representation of a chunk and of a question (ReKV).

ReKV (Di et al., "Streaming Video Question-Answering with In-context Video KV-Cache Retrieval",
ICLR 2025) retrieves video from its KV cache with the model's attention itself: a block of video
tokens is represented by the mean of its key vectors, a question by the mean of its query vectors,
both before rotary position embedding, and a block's score is their inner product, per layer
(keys of a grouped KV head serve every query head of its group). We follow it with two choices of
ours, because search needs one vector a chunk in one index, not a retrieval per layer:

- a few layers at fixed depths (`DEPTHS`: the middle of the stack, where cross-modal attention
  does its work; the first layers' keys are mostly token identity and position, the last ones'
  are shaped for the next token), one vector each;
- each layer's vector is normalised to unit length, so the score, the cosine of the concatenated
  vectors, is the mean over those layers of each layer's cosine: every layer counts alike and a
  score lies in [-1, 1] whatever the model's key norms.

Position independence: keys are stored rotated (M-RoPE). A chunk's keys are turned back by their
own positions (`unrotate`, exact: the rotation is orthogonal) before they are averaged, and so
are the question's queries, so a score depends on what was seen and asked, not on when.

A question is represented alone, without any stream's cache: the prompt prefix and
``<|vision_end|>{question}...assistant\\n`` (an empty video), its queries averaged over the
question's own tokens (the suffix). The query heads of one KV head's group are summed, which
makes the per-layer inner product with a chunk's (kv_heads, head_dim) keys ReKV's inner product
over all query heads.
"""

from __future__ import annotations

import numpy as np
import torch

from common.engine.answer import question_suffix_ids
from common.engine.lm import Item
from common.engine.positions import apply_rope, rope_cos_sin, text_positions
from common.engine.runtime import Runtime

DEPTHS = (0.375, 0.5, 0.625, 0.75)  # fractions of the layer stack whose keys and queries represent


def feature_layers(n_layers: int) -> tuple[int, ...]:
    """The layers a model of ``n_layers`` is represented at (3B, 36 layers: 13, 18, 22, 27)."""
    return tuple(sorted({min(n_layers - 1, int(d * n_layers)) for d in DEPTHS}))


def unrotate(x: torch.Tensor, positions: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """Keys or queries (..., L, head_dim) rotated at ``positions`` (3, L), turned back to before
    the rotary embedding, in float32 (the rotation's inverse: the same angles, negated)."""
    lm = rt.lm
    cos, sin = rope_cos_sin(positions, lm.inv_freq, lm.mrope_section, torch.float32)
    return apply_rope(x.float(), cos, -sin)


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """(layers, d) -> each layer's row at unit length, concatenated (layers * d,)."""
    return torch.nn.functional.normalize(x.flatten(1), dim=1).flatten()


def chunk_vector(rt: Runtime, kv: torch.Tensor, positions: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """A chunk's vector from its K/V as prefilled, ``kv`` (model layers, 2, kv_heads, n, hd) with
    keys rotated at ``positions`` (3, n): (len(layers) * kv_heads * hd,) float32 on the device."""
    # Views stacked, not `kv[list(layers), 0]`: indexing a CUDA tensor with a list waited for the
    # device, once a chunk, before the encode step's publish went on (readout_cost.py, 2026-11-29)
    keys = torch.stack([kv[layer, 0] for layer in layers])  # (L, kv_heads, n, hd)
    return _unit_rows(unrotate(keys, positions, rt).mean(dim=2))


@torch.inference_mode()
def question_vector(rt: Runtime, question: str, layers: tuple[int, ...]) -> np.ndarray:
    """The question's vector at ``layers``, comparable with `chunk_vector` (float32, on the host).
    Runs on the GPU loop: call it through ``rt.executor.call``."""
    prefix = rt.prefix_ids()
    ids = prefix + question_suffix_ids(rt, question)
    positions = text_positions(0, len(ids))
    lm, wanted, queries = rt.lm, set(layers), {}

    def tap(layer: int, q: torch.Tensor) -> None:  # q (T, heads, hd), rotated
        if layer in wanted:
            queries[layer] = q[len(prefix) :].transpose(0, 1)  # (heads, n, hd)

    scratch = lm.pool.alloc(len(ids))  # the forward writes its K/V somewhere; nobody reads them
    lm.queries(lm.embed(ids), positions, lm.plan([Item(len(ids), scratch, 0)]), tap, last=max(layers))
    q = torch.stack([queries[layer] for layer in layers])  # (L, heads, n, hd)
    mean = unrotate(q, positions[:, len(prefix) :], rt).mean(dim=2)  # (L, heads, hd)
    per_kv_head = mean.view(len(layers), lm.n_kv_heads, -1, lm.head_dim).sum(dim=2)  # a group's heads summed
    return _unit_rows(per_kv_head).cpu().numpy()
