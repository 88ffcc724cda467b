"""A stream's model grid and frame size rules; no torch, so ingest and clients import it cheaply.

Every stream has one fixed model grid, chosen once from the camera's size with Qwen's
``smart_resize`` (:func:`choose_grid`). Ingest resizes each frame to that grid before it goes on
the wire (:func:`resize_to_grid`: PIL bicubic, exactly what transformers' Qwen2-VL image
processor does; ``tests/test_frames.py`` proves both equal to transformers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

PATCH_PIXELS = 28  # vision patch 14 x spatial merge 2: one merged LLM token per 28x28 pixels
MAX_ASPECT = 200  # the longest side over the shortest that a grid is chosen for


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
        return self.height // PATCH_PIXELS, self.width // PATCH_PIXELS


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
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise FrameError(f"aspect ratio of {height}x{width} is over {MAX_ASPECT}")
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


def min_pixels_limit(max_grid_pixels: int, factor: int = PATCH_PIXELS) -> int:
    """The largest ``min_pixels`` whose grid stays within ``max_grid_pixels`` at every aspect ratio.

    Scaling a small frame up to ``min_pixels`` rounds each side up to a multiple of ``factor``
    (as transformers does), so the grid may hold up to ``factor * (h + w) + factor**2`` pixels
    more, where h * w = min_pixels and h + w is largest at MAX_ASPECT: a ``min_pixels`` just under
    the frame limit chose grids the encoder refuses.
    """
    spread = factor * (math.sqrt(MAX_ASPECT) + 1 / math.sqrt(MAX_ASPECT))  # (h + w) / sqrt(h * w), at most
    # the largest s = sqrt(min_pixels) with s**2 + spread * s + factor**2 <= max_grid_pixels
    root = (-spread + math.sqrt(spread**2 + 4 * (max_grid_pixels - factor**2))) / 2
    return math.floor(root**2)


def check_frame(frame: object, index: int | None = None) -> np.ndarray:
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
    check_frame(frame)
    if frame.shape[:2] == (grid.height, grid.width):
        return frame
    resized = Image.fromarray(np.ascontiguousarray(frame)).resize(
        (grid.width, grid.height), resample=Image.Resampling.BICUBIC
    )
    return np.asarray(resized)
