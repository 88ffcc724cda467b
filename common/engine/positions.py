"""M-RoPE positions for one continuous video block, computed by us and passed explicitly.

Reference semantics (the Qwen2.5-VL release; transformers <= 5.2). For video start `s` (the
position right after <|vision_start|>), temporal patch `g` and merged grid cell `(i, j)`:

    t = s + trunc(f32(f32(g) * f32(temporal_patch / fps)) * tokens_per_second)      h = s + i      w = s + j

and text after the video starts at (max over all three axes of the video) + 1. The temporal
product is float32 as the release computes it (seconds_per_grid_ts is a float32 tensor, the
product is truncated by .long()), not exact: at NTSC rates (24000/1001 fps) exact fractions
part from the release by one at some patches past 6,000. Newer transformers differ (text
restarts at s + max(h, w); fractional intervals were truncated), which is why nothing here
asks the library for positions.

Keys are cached *after* rotation. The temporal axis owns its own frequency band (the first
mrope_section[0] frequencies, mirrored in both halves of the head), so moving cached keys by
Δt is one rotation of that band: `shift_temporal` is how re-basing moves retained chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def text_positions(start: int, n: int) -> torch.Tensor:
    """(3, n): text tokens advance all three axes together."""
    return torch.arange(start, start + n, dtype=torch.long).expand(3, n).clone()


@dataclass(frozen=True)
class TemporalStep:
    """How far the temporal position moves per temporal patch, in the release's float32 arithmetic."""

    seconds_per_grid: np.float32
    tokens_per_second: np.float32

    @classmethod
    def for_fps(cls, fps: float, temporal_patch: int, tokens_per_second: int) -> TemporalStep:
        # The release's processor divides in Python floats, then stores the quotient as float32.
        return cls(np.float32(temporal_patch / fps), np.float32(tokens_per_second))

    def offsets(self, first_patch: int, n_patches: int) -> np.ndarray:
        """Temporal offsets of patches first_patch .. first_patch + n_patches - 1 from the video start."""
        g = np.arange(first_patch, first_patch + n_patches, dtype=np.int64).astype(np.float32)
        return (g * self.seconds_per_grid * self.tokens_per_second).astype(np.int64)

    def offset(self, g: int) -> int:
        return int(self.offsets(g, 1)[0])


def video_positions(
    start: int, first_patch: int, n_patches: int, grid_h: int, grid_w: int, interval: TemporalStep
) -> torch.Tensor:
    """(3, n_patches*grid_h*grid_w) positions of merged video tokens in (t, h, w) order.

    `grid_h`, `grid_w` count merged tokens (pixels / 28); `first_patch` is the logical index
    of the chunk's first temporal patch within the stream's video block.
    """
    t = torch.from_numpy(interval.offsets(first_patch, n_patches)) + start
    h = torch.arange(grid_h) + start
    w = torch.arange(grid_w) + start
    tt, hh, ww = torch.meshgrid(t, h, w, indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1).long()


def next_text_position(video_start: int, n_patches: int, grid_h: int, grid_w: int, interval: TemporalStep) -> int:
    """First text position after a video of `n_patches` logical patches starting at `video_start`."""
    if n_patches == 0:
        return video_start
    t_max = video_start + interval.offset(n_patches - 1)
    return max(t_max, video_start + grid_h - 1, video_start + grid_w - 1) + 1


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (L, head_dim) for (3, L) positions, computed as Qwen2.5-VL does:
    frequency k takes its angle from axis t, h or w by `mrope_section`, then both halves."""
    freqs = positions.to(inv_freq.device, non_blocking=True)[..., None].float() * inv_freq.float()  # (3, L, hd/2)
    parts = freqs.split(mrope_section, dim=-1)
    freqs = torch.cat([part[axis % 3] for axis, part in enumerate(parts)], dim=-1)  # (L, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., L, head_dim) rotated by cos/sin (L, head_dim)."""
    return x * cos + rotate_half(x) * sin


def shift_temporal(
    keys: torch.Tensor, delta_t: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int]
) -> torch.Tensor:
    """Keys (..., L, head_dim) already rotated at positions p, returned as if rotated at
    p + (delta_t, 0, 0). Only the temporal band turns; h and w bands are untouched.
    Computed in fp32 so repeated re-basing does not accumulate bf16 rounding."""
    zeros = torch.zeros_like(delta_t)
    cos, sin = rope_cos_sin(torch.stack([delta_t, zeros, zeros]), inv_freq, mrope_section, torch.float32)
    return apply_rope(keys.float(), cos, sin).to(keys.dtype)
