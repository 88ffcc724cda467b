"""common.engine.frames against transformers' own Qwen2-VL preprocessing (the PIL image processor and
smart_resize), which needs no torchvision: one image there is one temporal patch of two
identical frames."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import OPENAI_CLIP_MEAN as HF_MEAN
from transformers.image_utils import OPENAI_CLIP_STD as HF_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)

from common.engine.frames import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, frames_to_pixels, pad_to_temporal
from common.engine.grid import FrameError, Grid, choose_grid, resize_to_grid

MIN_PIXELS, MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28


def _image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A smooth gradient plus noise: resizing it exercises the bicubic kernel, not only noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([yy * 255 / height, xx * 255 / width, (yy + xx) * 127 / (height + width)], axis=-1)
    return np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)


def _processor(**kwargs) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, **kwargs)


def _reference(img: np.ndarray, **kwargs) -> tuple[np.ndarray, tuple[int, int, int]]:
    out = _processor(**kwargs)(images=[Image.fromarray(img)], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def test_clip_constants_match_transformers():
    assert tuple(HF_MEAN) == OPENAI_CLIP_MEAN
    assert tuple(HF_STD) == OPENAI_CLIP_STD


@pytest.mark.parametrize(
    ("height", "width"),
    [(448, 448), (336, 616), (479, 641), (1080, 1920)],  # as is, as is, rounded, scaled down
)
def test_matches_image_processor_bitwise(height, width):
    img = _image(height, width)
    ref_pixels, ref_thw = _reference(img)  # processor resizes itself (do_resize=True)
    grid = choose_grid(height, width, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)

    pixels, thw = frames_to_pixels([img, img], grid)  # resized inside frames_to_pixels
    assert thw == ref_thw == (1, grid.height // 14, grid.width // 14)
    assert pixels.dtype == torch.float32
    assert torch.equal(pixels, torch.from_numpy(ref_pixels))

    # The wire path: ingest resizes once, the worker only normalises + patchifies.
    on_wire = resize_to_grid(img, grid)
    assert on_wire.shape == (grid.height, grid.width, 3) and on_wire.dtype == np.uint8
    pixels_wire, _ = frames_to_pixels(np.stack([on_wire, on_wire]), grid)
    assert torch.equal(pixels_wire, pixels)
    # ... and the processor without its own resize agrees on the already-resized frame.
    ref_noresize, _ = _reference(on_wire, do_resize=False)
    assert torch.equal(pixels_wire, torch.from_numpy(ref_noresize))
    assert grid.tokens_per_patch * 4 == thw[1] * thw[2]


def test_video_chunking_and_temporal_layout():
    grid = Grid(56, 84)
    frames = [_image(56, 84, seed=s) for s in range(4)]
    pixels, thw = frames_to_pixels(frames, grid)
    gh, gw = 56 // 14, 84 // 14
    assert thw == (2, gh, gw)
    assert pixels.shape == (2 * gh * gw, 3 * 2 * 14 * 14)

    # Chunking invariance: 4 frames at once == [0, 1] then [2, 3].
    first, thw_a = frames_to_pixels(frames[:2], grid)
    second, thw_b = frames_to_pixels(frames[2:], grid)
    assert thw_a == thw_b == (1, gh, gw)
    assert torch.equal(pixels, torch.cat([first, second]))

    # Layout: rows of temporal patch t, temporal slot k hold frame 2t + k, in the same spatial
    # order as the processor's rows for that frame alone (where both slots are the frame).
    rows = pixels.reshape(2, gh * gw, 3, 2, 14, 14)
    for t in range(2):
        for k in range(2):
            ref, _ = _reference(frames[2 * t + k], do_resize=False)
            ref_slot = torch.from_numpy(ref).reshape(gh * gw, 3, 2, 14, 14)[:, :, 0]
            assert torch.equal(rows[t, :, :, k], ref_slot)

    # A (T, H, W, 3) array gives the same as a list.
    assert torch.equal(frames_to_pixels(np.stack(frames), grid)[0], pixels)


def test_patch_order_by_hand():
    """Row r of patch t is merge block (r // 4), sub-patch (r % 4) in row-major 2x2 order."""
    grid = Grid(56, 56)
    video = np.zeros((2, 56, 56, 3), np.uint8)
    video[1, 14:28, 28:42] = 255  # frame 1, patch (row 1, col 2) -> block (0, 1), sub-patch (1, 0)
    pixels, _ = frames_to_pixels(video, grid, mean=(0, 0, 0), std=(1, 1, 1))
    hot = pixels.reshape(16, 3, 2, 14, 14).amax(dim=(1, 3, 4))  # (row, temporal slot)
    expected = torch.zeros(16, 2)
    expected[1 * 4 + 2, 1] = 1.0  # block index 1 (row-major over 2x2 blocks), sub-patch index 2
    assert torch.equal(hot, expected)


def test_choose_grid_equals_smart_resize():
    sizes = [*range(1, 60), *range(60, 4000, 53), 42, 70, 98, 126, 1080, 1920, 2160, 3840]
    limits = [(MIN_PIXELS, MAX_PIXELS), (56 * 56, 28 * 28 * 1280), (4 * 28 * 28, 64 * 28 * 28)]
    checked = 0
    for min_pixels, max_pixels in limits:
        for h in sizes:
            for w in sizes:
                try:
                    expected = smart_resize(h, w, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
                except ValueError:
                    with pytest.raises(FrameError, match="aspect"):
                        choose_grid(h, w, min_pixels=min_pixels, max_pixels=max_pixels)
                    continue
                grid = choose_grid(h, w, min_pixels=min_pixels, max_pixels=max_pixels)
                assert (grid.height, grid.width) == expected, (h, w, min_pixels, max_pixels)
                checked += 1
    assert checked > 10_000


def test_choose_grid_defaults():
    grid = choose_grid(1080, 1920)
    assert (grid.height, grid.width) == smart_resize(1080, 1920, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert grid.height % 28 == 0 and grid.width % 28 == 0
    assert grid.tokens_per_patch == (grid.height // 28) * (grid.width // 28) <= 768


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "no frames"),
        ([np.zeros((56, 56), np.uint8)] * 2, r"frame 0 .*\(56, 56\)"),
        ([np.zeros((56, 56, 3), np.uint8), np.zeros((56, 56, 4), np.uint8)], r"frame 1 .*\(56, 56, 4\)"),
        ([np.zeros((56, 56, 3), np.float32)] * 2, r"frame 0 must be uint8.*float32"),
        ([np.zeros((56, 56, 3), np.uint8), np.zeros((56, 84, 3), np.uint8)], r"frame 1 .*\(56, 84, 3\)"),
        ([np.zeros((0, 56, 3), np.uint8)] * 2, "frame 0 is empty"),
        ([np.zeros((56, 56, 3), np.uint8)] * 3, "multiple of temporal_patch_size"),
        (np.zeros((56, 56, 3), np.uint8), r"\(T, H, W, 3\)"),
        (np.zeros((0, 56, 56, 3), np.uint8), "positive multiple"),
        (["not an array"] * 2, "numpy array"),
    ],
    ids=["empty", "grayscale", "rgba", "float", "mismatched", "zero-size", "odd", "3d", "none", "type"],
)
def test_frames_to_pixels_rejects(frames, match):
    with pytest.raises(FrameError, match=match):
        frames_to_pixels(frames, Grid(56, 56))


def test_bad_grid_and_sizes():
    with pytest.raises(FrameError, match="multiple of 28"):
        frames_to_pixels([np.zeros((50, 50, 3), np.uint8)] * 2, Grid(50, 50))
    for h, w in [(0, 640), (480, 0), (-1, 640)]:
        with pytest.raises(FrameError, match="positive"):
            choose_grid(h, w)
    with pytest.raises(FrameError, match="aspect"):
        choose_grid(10, 2010)
    with pytest.raises(FrameError):
        Grid(0, 28)
    with pytest.raises(FrameError, match="RGB"):
        resize_to_grid(np.zeros((56, 56, 4), np.uint8), Grid(28, 28))
    with pytest.raises(FrameError, match="3 values"):
        frames_to_pixels([np.zeros((28, 28, 3), np.uint8)] * 2, Grid(28, 28), mean=(0.5,))
    assert issubclass(FrameError, ValueError)


def test_resize_to_grid_noop_and_pil_bicubic():
    img = _image(56, 84)
    assert resize_to_grid(img, Grid(56, 84)) is img
    expected = np.asarray(Image.fromarray(img).resize((56, 28), Image.Resampling.BICUBIC))
    assert np.array_equal(resize_to_grid(img, Grid(28, 56)), expected)


def test_pad_to_temporal():
    a, b, c = (np.full((28, 28, 3), v, np.uint8) for v in (1, 2, 3))
    one = [a]
    padded, n = pad_to_temporal(one)
    assert n == 1 and len(padded) == 2 and padded[1] is a and one == [a]  # input untouched
    padded, n = pad_to_temporal([a, b])
    assert n == 0 and [f is g for f, g in zip(padded, [a, b], strict=True)] == [True, True]
    padded, n = pad_to_temporal([a, b, c])
    assert n == 1 and len(padded) == 4 and padded[3] is c
    assert pad_to_temporal([]) == ([], 0)
    assert pad_to_temporal([a, b, c], temporal_patch_size=4)[1] == 1
    frames_to_pixels(pad_to_temporal([a, b, c])[0], Grid(28, 28))  # padded list is accepted


def test_module_imports_neither_transformers_nor_torchvision():
    code = "import sys, common.engine.frames\n"
    code += "print([m for m in ('transformers', 'torchvision') if m in sys.modules])"
    repo = Path(__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert out.stdout.strip() == "[]"
