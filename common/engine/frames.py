"""Video frames -> Qwen2.5-VL vision-tower input (``pixel_values``, ``grid_thw``).

Every stream has one fixed model grid, chosen once from the camera's size with Qwen's
``smart_resize`` (:func:`choose_grid`). Ingest resizes each frame to that grid before it goes
on the wire (:func:`resize_to_grid`: PIL bicubic, exactly what transformers' Qwen2-VL image
processor does), so the encoder worker only rescales, normalises and patchifies
(:func:`frames_to_pixels`) — vectorised, no per-pixel Python, on every chunk of live video.

This module does not import transformers (the Qwen2-VL video processor needs torchvision,
which we do not install); ``tests/test_frames.py`` proves it equal to transformers' PIL image
processor and ``smart_resize``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class FrameError(ValueError):
    """A frame, frame list or size that the vision tower cannot take."""


@dataclass(frozen=True)
class Grid:
    """A stream's fixed model grid in pixels; both sides multiples of 28 (patch 14 * merge 2)."""

    height: int
    width: int

    def __post_init__(self) -> None:
        if self.height <= 0 or self.width <= 0:
            raise FrameError(f"grid must have positive sides, got {self.height}x{self.width}")

    @property
    def tokens_per_patch(self) -> int:
        """Merged LLM tokens per temporal patch (= 2 frames)."""
        rows, cols = self.merged_hw
        return rows * cols

    @property
    def merged_hw(self) -> tuple[int, int]:
        """Merged LLM tokens per temporal patch as (rows, cols)."""
        return self.height // 28, self.width // 28


@dataclass(frozen=True)
class StreamSpec:
    name: str
    fps: float
    grid: Grid
    chunk_frames: int = 4

    def __post_init__(self) -> None:
        if not (self.fps > 0):
            raise ValueError(f"fps must be positive, got {self.fps}")
        if self.chunk_frames <= 0 or self.chunk_frames % 2:
            raise ValueError(f"chunk_frames must be a positive even number, got {self.chunk_frames}")


def choose_grid(
    height: int,
    width: int,
    *,
    min_pixels: int = 128 * 28 * 28,
    max_pixels: int = 768 * 28 * 28,
    factor: int = 28,
) -> Grid:
    """Qwen's ``smart_resize``: nearest multiples of ``factor``, then scaled into [min, max] pixels."""
    if height <= 0 or width <= 0:
        raise FrameError(f"frame size must be positive, got {height}x{width}")
    if factor <= 0 or min_pixels <= 0 or max_pixels < min_pixels:
        raise FrameError(f"bad limits: factor {factor}, min_pixels {min_pixels}, max_pixels {max_pixels}")
    if max(height, width) / min(height, width) > 200:
        raise FrameError(f"aspect ratio of {height}x{width} is over 200")
    # Same float expressions as transformers' smart_resize (round() is round-half-to-even there too).
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return Grid(h_bar, w_bar)


def _check_frame(frame: object, index: int | None = None) -> np.ndarray:
    name = "frame" if index is None else f"frame {index}"
    if not isinstance(frame, np.ndarray):
        raise FrameError(f"{name} must be a numpy array, got {type(frame).__name__}")
    if frame.ndim != 3 or frame.shape[2] != 3:
        raise FrameError(f"{name} must be HxWx3 RGB, got shape {frame.shape}")
    if frame.dtype != np.uint8:
        raise FrameError(f"{name} must be uint8, got {frame.dtype} (shape {frame.shape})")
    if frame.shape[0] == 0 or frame.shape[1] == 0:
        raise FrameError(f"{name} is empty, shape {frame.shape}")
    return frame


def resize_to_grid(frame: np.ndarray, grid: Grid) -> np.ndarray:
    """HxWx3 uint8 RGB -> grid-sized HxWx3 uint8, PIL bicubic like transformers' Qwen2-VL processor."""
    _check_frame(frame)
    if frame.shape[:2] == (grid.height, grid.width):
        return frame
    resized = Image.fromarray(np.ascontiguousarray(frame)).resize(
        (grid.width, grid.height), resample=Image.Resampling.BICUBIC
    )
    return np.asarray(resized)


@lru_cache(maxsize=8)
def _normalise_table(mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """(256, 3) float32: value v of channel c -> ((v * 1/255 in float64 -> float32) - mean) / std.

    The same float operations as transformers' rescale + normalize, so a gather through this
    table is bit-identical to it (and faster than computing per pixel).
    """
    scaled = (torch.arange(256, dtype=torch.float64) * (1 / 255)).to(torch.float32)
    mean_t = torch.tensor(mean, dtype=torch.float32)
    std_t = torch.tensor(std, dtype=torch.float32)
    return (scaled[:, None] - mean_t) / std_t


def _stack(frames: Sequence[np.ndarray] | np.ndarray, grid: Grid) -> np.ndarray:
    """Validate frames and return them as one (T, grid.height, grid.width, 3) uint8 array."""
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4:
            raise FrameError(f"a frame array must be (T, H, W, 3), got shape {frames.shape}")
        if frames.dtype == np.uint8 and frames.shape[1:] == (grid.height, grid.width, 3):
            return frames  # fast path: already what the wire carries
    if len(frames) == 0:
        raise FrameError("no frames")
    first = _check_frame(frames[0], 0)
    for i, frame in enumerate(frames):
        if _check_frame(frame, i).shape != first.shape:
            raise FrameError(f"frame {i} has shape {frame.shape}, frame 0 has {first.shape}")
    return np.stack([resize_to_grid(frame, grid) for frame in frames])


def frames_to_pixels(
    frames: Sequence[np.ndarray] | np.ndarray,
    grid: Grid,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames -> (pixel_values float32 (t*h*w, 3*temporal*patch*patch), grid_thw in patch units).

    Frames not at the grid size are resized to it; their count must be a positive multiple of
    ``temporal_patch_size`` (pad with :func:`pad_to_temporal`). Rows come in Qwen2-VL's order:
    temporal patch, then 2x2 merge blocks row-major, then the patches inside a block.
    """
    factor = patch_size * merge_size
    if grid.height % factor or grid.width % factor:
        raise FrameError(f"grid {grid.height}x{grid.width} is not a multiple of {factor}")
    video = _stack(frames, grid)
    n = video.shape[0]
    if n == 0 or n % temporal_patch_size:
        raise FrameError(f"{n} frames: need a positive multiple of temporal_patch_size={temporal_patch_size}")

    if len(mean) != 3 or len(std) != 3:
        raise FrameError(f"mean and std need 3 values (RGB), got {len(mean)} and {len(std)}")
    table = _normalise_table(tuple(map(float, mean)), tuple(map(float, std)))
    x = torch.from_numpy(np.ascontiguousarray(video))
    x = table[x.long(), torch.arange(3)]  # (T, H, W, 3) float32

    t, gh, gw = n // temporal_patch_size, grid.height // patch_size, grid.width // patch_size
    m, p = merge_size, patch_size
    # (t, tp, gh/m, m, p, gw/m, m, p, C) -> (t, gh/m, gw/m, m, m, C, tp, p, p)
    x = x.reshape(t, temporal_patch_size, gh // m, m, p, gw // m, m, p, 3)
    x = x.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    pixels = x.reshape(t * gh * gw, 3 * temporal_patch_size * p * p)
    return pixels, (t, gh, gw)


def pad_to_temporal(frames: list[np.ndarray], temporal_patch_size: int = 2) -> tuple[list[np.ndarray], int]:
    """Repeat the last frame until the count is a multiple of ``temporal_patch_size``.

    Returns a new list and the number of frames added (0 when already a multiple, or empty).
    """
    if temporal_patch_size <= 0:
        raise FrameError(f"temporal_patch_size must be positive, got {temporal_patch_size}")
    pad = -len(frames) % temporal_patch_size
    return list(frames) + list(frames[-1:]) * pad, pad
