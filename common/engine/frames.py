"""Video frames -> Qwen2.5-VL vision-tower input (``pixel_values``, ``grid_thw``).

Ingest has already resized each frame to its stream's grid (``grid.py``), so the encoder worker
only stacks a chunk's frames (:func:`stack_frames`, on the host) and rescales, normalises and
patchifies them (:func:`patchify`, vectorised, on the device that runs the vision tower).

This module does not import transformers (the Qwen2-VL video processor needs torchvision,
which we do not install); ``tests/test_frames.py`` proves it equal to transformers' PIL image
processor and ``smart_resize``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from common.engine.grid import FrameError, Grid, check_frame, resize_to_grid

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@lru_cache(maxsize=8)
def _normalise_table(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """(256, 3) float32: value v of channel c -> ((v * 1/255 in float64 -> float32) - mean) / std.

    The same float operations as transformers' rescale + normalize, so a gather through this
    table is bit-identical to it (and faster than computing per pixel), on any device.
    """
    scaled = (torch.arange(256, dtype=torch.float64) * (1 / 255)).to(torch.float32)
    mean_t = torch.tensor(mean, dtype=torch.float32)
    std_t = torch.tensor(std, dtype=torch.float32)
    return ((scaled[:, None] - mean_t) / std_t).to(device)


def _stack(frames: Sequence[np.ndarray] | np.ndarray, grid: Grid) -> np.ndarray:
    """Validate frames and return them as one (T, grid.height, grid.width, 3) uint8 array."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4:
            raise FrameError(f"a frame array must be (T, H, W, 3), got shape {frames.shape}")
        if frames.dtype == np.uint8 and frames.shape[1:] == (grid.height, grid.width, 3):
            return frames  # fast path: already what the wire carries
    if len(frames) == 0:
        raise FrameError("no frames")
    first = check_frame(frames[0], 0)
    for i, frame in enumerate(frames):
        if check_frame(frame, i).shape != first.shape:
            raise FrameError(f"frame {i} has shape {frame.shape}, frame 0 has {first.shape}")
    return np.stack([resize_to_grid(frame, grid) for frame in frames])


def stack_frames(
    frames: Sequence[np.ndarray] | np.ndarray,
    grid: Grid,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Frames -> one (T, grid.height, grid.width, 3) uint8 tensor for :func:`patchify`, resized to
    the grid where they are not at it; their count must be a positive multiple of
    ``temporal_patch_size`` (pad with :func:`pad_to_temporal`). ``pin_memory`` (a GPU will read
    them): in page-locked memory, so the copy to the device is asynchronous."""
    factor = patch_size * merge_size
    if grid.height % factor or grid.width % factor:
        raise FrameError(f"grid {grid.height}x{grid.width} is not a multiple of {factor}")
    video = torch.from_numpy(np.ascontiguousarray(_stack(frames, grid)))
    n = video.shape[0]
    if n == 0 or n % temporal_patch_size:
        raise FrameError(f"{n} frames: need a positive multiple of temporal_patch_size={temporal_patch_size}")
    return video.pin_memory() if pin_memory else video


def patchify(
    video: torch.Tensor,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A :func:`stack_frames` tensor -> (pixel_values float32 (t*h*w, 3*temporal*patch*patch),
    grid_thw in patch units), on the video's device: on a GPU the host copies a quarter of the
    bytes (uint8, not float32) and does none of the arithmetic.

    Rows come in Qwen2-VL's order: temporal patch, then 2x2 merge blocks row-major, then the
    patches inside a block.
    """
    if len(mean) != 3 or len(std) != 3:
        raise FrameError(f"mean and std need 3 values (RGB), got {len(mean)} and {len(std)}")
    table = _normalise_table(tuple(map(float, mean)), tuple(map(float, std)), video.device)
    x = table[video.long(), torch.arange(3, device=video.device)]  # (T, H, W, 3) float32

    t, gh, gw = video_grid_thw(video, patch_size=patch_size, temporal_patch_size=temporal_patch_size)
    m, p = merge_size, patch_size
    # (t, tp, gh/m, m, p, gw/m, m, p, C) -> (t, gh/m, gw/m, m, m, C, tp, p, p)
    x = x.reshape(t, temporal_patch_size, gh // m, m, p, gw // m, m, p, 3)
    x = x.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return x.reshape(t * gh * gw, 3 * temporal_patch_size * p * p), (t, gh, gw)


def video_grid_thw(video: torch.Tensor, *, patch_size: int = 14, temporal_patch_size: int = 2) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of a :func:`stack_frames` tensor."""
    n, height, width, _ = video.shape
    return n // temporal_patch_size, height // patch_size, width // patch_size


def frames_to_pixels(
    frames: Sequence[np.ndarray] | np.ndarray,
    grid: Grid,
    *,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames -> (pixel_values, grid_thw) on the CPU: :func:`stack_frames` then :func:`patchify`."""
    return patchify(stack_frames(frames, grid), mean=mean, std=std)


def pad_to_temporal(frames: list[np.ndarray], temporal_patch_size: int = 2) -> tuple[list[np.ndarray], int]:
    """Repeat the last frame until the count is a multiple of ``temporal_patch_size``.

    Returns a new list and the number of frames added (0 when already a multiple, or empty).
    """
    if temporal_patch_size <= 0:
        raise FrameError(f"temporal_patch_size must be positive, got {temporal_patch_size}")
    pad = -len(frames) % temporal_patch_size
    return list(frames) + list(frames[-1:]) * pad, pad
