"""Retrieval representations computed independently of the engine: transformers' own forward
(`output_hidden_states`), the layers' own q_proj/k_proj on each layer's normed input, which are the
keys and queries before any rotary embedding. Nothing of common/engine/features.py is used: the
engine's vectors (un-rotated from its cache) and scores must equal these."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.engine.answer import question_suffix_ids
from common.engine.grid import Grid
from common.engine.offline import offline_prompt
from common.engine.runtime import Runtime


def _layer_inputs(rt: Runtime, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        out = rt.loaded.model(**inputs, output_hidden_states=True, use_cache=False)
    return tuple(h[0] for h in out.hidden_states)  # [l]: the input of layer l, (T, D)


def _projected(rt: Runtime, hidden: torch.Tensor, layer: int, proj: str) -> np.ndarray:
    block = rt.loaded.model.model.language_model.layers[layer]
    with torch.inference_mode():
        return getattr(block.self_attn, proj)(block.input_layernorm(hidden)).float().cpu().numpy()


def chunk_means(
    rt: Runtime, frames: Sequence[np.ndarray], grid: Grid, fps: float, chunk: int, layers: Sequence[int]
) -> list[np.ndarray]:
    """Per chunk of ``chunk`` frames (one-shot over all of them, as an unevicted stream holds them):
    its keys' mean per layer and KV head, (layers, kv_heads, hd)."""
    ids, pixels, grid_thw, pos, _ = offline_prompt(rt, frames, grid, fps, "?")
    hidden = _layer_inputs(rt, input_ids=ids, pixel_values_videos=pixels, video_grid_thw=grid_thw, position_ids=pos)
    cfg = rt.loaded.text_config
    hd = cfg.hidden_size // cfg.num_attention_heads
    start = len(rt.prefix_ids())
    per_chunk = (ids[0] == rt.ids.video_pad).sum().item() * chunk // len(frames)
    out = []
    for c in range(len(frames) // chunk):
        lo = start + c * per_chunk
        keys = [_projected(rt, hidden[layer][lo : lo + per_chunk], layer, "k_proj") for layer in layers]
        out.append(np.stack([k.reshape(per_chunk, -1, hd).mean(axis=0) for k in keys]))
    return out


def question_means(rt: Runtime, question: str, layers: Sequence[int]) -> np.ndarray:
    """The question's queries' mean per layer and head over its own tokens, alone after the
    prompt prefix (no video), (layers, heads, hd)."""
    prefix = rt.prefix_ids()
    ids = torch.tensor([prefix + question_suffix_ids(rt, question)])
    hidden = _layer_inputs(rt, input_ids=ids)
    cfg = rt.loaded.text_config
    hd = cfg.hidden_size // cfg.num_attention_heads
    queries = [_projected(rt, hidden[layer][len(prefix) :], layer, "q_proj") for layer in layers]
    return np.stack([q.reshape(q.shape[0], -1, hd).mean(axis=0) for q in queries])


def score(question: np.ndarray, chunk: np.ndarray) -> float:
    """ReKV's per-layer inner product (every query head with its group's KV head) as a cosine,
    averaged over the layers."""
    kv_heads = chunk.shape[1]
    cosines = []
    for q, k in zip(question, chunk, strict=True):
        k_for_each_head = np.repeat(k, q.shape[0] // kv_heads, axis=0)  # (heads, hd), as attention reads it
        dot = float((q * k_for_each_head).sum())
        q_norm = np.linalg.norm(q.reshape(kv_heads, -1, q.shape[1]).sum(axis=1))  # the group-summed query
        cosines.append(dot / (q_norm * np.linalg.norm(k)))
    return float(np.mean(cosines))
