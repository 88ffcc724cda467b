"""Ordinary one-shot inference with transformers: the oracle the streaming engine must equal.

Everything here goes through transformers' own forward (its vision placement, its attention,
its DynamicCache), with one exception: positions come from the reference formula
(positions.py), because transformers >= 5.3 computes video positions differently from the
Qwen2.5-VL release. The decode loop is plain greedy/explicit-position so it does not depend
on generate()'s position inference either. With `gemm_dtype: fp8` the model's dense layers are
FP8Linear modules (fp8.py), quantized as the engine's products are: the oracle of that mode too.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.engine.answer import question_suffix_ids
from common.engine.frames import frames_to_pixels, pad_to_temporal
from common.engine.grid import Grid
from common.engine.positions import next_text_position, text_positions, video_positions
from common.engine.runtime import Runtime


@dataclass
class OfflineResult:
    text: str
    token_ids: list[int]
    first_logits: torch.Tensor  # logits of the first answer token
    prompt_tokens: int


def offline_prompt(rt: Runtime, frames: Sequence[np.ndarray], grid: Grid, fps: float, question: str):
    """input_ids (1, L), pixel values, grid_thw and reference positions (3, 1, L) for one video + question."""
    padded, _ = pad_to_temporal(list(frames), rt.loaded.temporal_patch_size)
    pixels, grid_thw = frames_to_pixels(padded, grid)
    merge = rt.loaded.vision_config.spatial_merge_size
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    prefix, suffix = rt.prefix_ids(), question_suffix_ids(rt, question)
    n_video = t * h * w
    ids = prefix + [rt.ids.video_pad] * n_video + suffix
    interval = rt.loaded.temporal_interval(fps)
    s = len(prefix)
    text_at = next_text_position(s, t, h, w, interval)
    pos = torch.cat(
        [text_positions(0, s), video_positions(s, 0, t, h, w, interval), text_positions(text_at, len(suffix))], dim=1
    )
    return torch.tensor([ids]), pixels, torch.tensor([grid_thw]), pos[:, None, :], text_at + len(suffix)


@torch.inference_mode()
def offline_answer(
    rt: Runtime, frames: Sequence[np.ndarray], grid: Grid, fps: float, question: str, max_tokens: int = 32
) -> OfflineResult:
    model, dev = rt.loaded.model, rt.loaded.device
    ids, pixels, grid_thw, pos, next_pos = offline_prompt(rt, frames, grid, fps, question)
    out = model(
        input_ids=ids.to(dev),
        pixel_values_videos=pixels.to(dev),
        video_grid_thw=grid_thw.to(dev),
        position_ids=pos.to(dev),
        use_cache=True,
    )
    logits, cache = out.logits[0, -1].float(), _cache_of(out)
    cache_arg = _cache_arg(model)
    first_logits = logits
    tokens: list[int] = []
    stops = {rt.ids.im_end, rt.ids.endoftext}
    for _ in range(max_tokens):
        token = int(torch.argmax(logits))
        if token in stops:
            break
        tokens.append(token)
        step_pos = torch.full((3, 1, 1), next_pos, device=dev)
        token_ids = torch.tensor([[token]], device=dev)
        out = model(input_ids=token_ids, position_ids=step_pos, use_cache=True, **{cache_arg: cache})
        logits, cache = out.logits[0, -1].float(), _cache_of(out)
        next_pos += 1
    text = rt.tokenizer.decode(tokens, skip_special_tokens=True)
    return OfflineResult(text, tokens, first_logits.cpu(), ids.shape[1])


# transformers renamed the KV cache from `past_key_values` to `cache`, in the forward's arguments
# and in its output (5.2x; the old name warns, and goes in 5.40): the GPU image has 5.17, CI the newest 5.x
def _cache_arg(model: torch.nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _cache_of(out: object) -> object:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
