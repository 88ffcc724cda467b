"""Oracles for our batched vision tower (common/engine/vision.py): it must give exactly what
transformers' own Qwen2.5-VL vision tower gives for each chunk alone (CPU fp32, ≤ 1e-5), on
square and non-square grids, grids that are not a multiple of the window, and batches that mix
grids; and, on a GPU, agree with it in bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from common.engine.frames import frames_to_pixels
from common.engine.grid import FrameError, Grid
from common.engine.model import LoadedModel, load_model, qwen3b_config, tiny_config
from common.engine.runtime import Runtime
from common.engine.vision import MLP_ALIGN, VisionTower

TOL = 1e-5
# tiny-random: window 56 px = 2x2 merged tokens. (1, 8, 8) tiles exactly; the others leave edge
# windows of 1 or 3 tokens, in height, width or both; (1, 2, 2) is smaller than one window.
GRIDS = [(1, 8, 8), (2, 4, 6), (2, 6, 4), (2, 6, 10), (3, 10, 4), (1, 14, 18), (1, 2, 2)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("tiny-random", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tower(loaded) -> VisionTower:
    return VisionTower(loaded)


def model_from(config, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A random model of any geometry, built like load_model builds tiny-random (no tokenizer)."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(dtype).eval()
    return LoadedModel(model, None, "test", None, torch.device(device), dtype)


def chunk(grid: tuple[int, int, int], seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, tuple]:
    t, h, w = grid
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=gen).to(device), grid


@torch.inference_mode()
def reference(loaded: LoadedModel, pixels: torch.Tensor, grid) -> torch.Tensor:
    visual = loaded.model.model.visual
    grid_thw = torch.tensor([grid], device=pixels.device)
    return visual(pixels.to(visual.dtype), grid_thw=grid_thw).pooler_output


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_equals_transformers_on_one_chunk(loaded, tower, grid):
    pixels, _ = chunk(grid)
    (ours,) = tower([(pixels, grid)])
    assert max_diff(ours, reference(loaded, pixels, grid)) <= TOL


@pytest.mark.parametrize("n_frames", [2, 4, 6])
@pytest.mark.parametrize("grid", [Grid(56, 84), Grid(84, 56)], ids=["56x84", "84x56"])
def test_equals_transformers_on_video_frames(loaded, tower, grid, n_frames):
    frames = np.random.default_rng(n_frames).integers(0, 256, (n_frames, grid.height, grid.width, 3), dtype=np.uint8)
    pixels, grid_thw = frames_to_pixels(frames, grid)
    (ours,) = tower([(pixels, grid_thw)])
    assert ours.shape[0] == grid.tokens_per_patch * n_frames // 2
    assert max_diff(ours, reference(loaded, pixels, grid_thw)) <= TOL


def test_mixed_batch_equals_each_chunk_alone(loaded, tower):
    chunks = [chunk(g, seed) for seed, g in enumerate([(2, 4, 6), (1, 8, 8), (3, 10, 4), (2, 4, 6), (1, 2, 2)])]
    batched = tower(chunks)
    assert len(batched) == len(chunks)
    for (pixels, grid), ours in zip(chunks, batched, strict=True):
        assert max_diff(ours, tower([(pixels, grid)])[0]) <= 1e-6
        assert max_diff(ours, reference(loaded, pixels, grid)) <= TOL


def test_batch_of_one_grid_equals_each_chunk_alone(loaded, tower):
    """Many chunks of one grid: every window and frame has one size, the reshape path."""
    chunks = [chunk((2, 8, 8), seed) for seed in range(5)]
    for (pixels, grid), ours in zip(chunks, tower(chunks), strict=True):
        assert max_diff(ours, reference(loaded, pixels, grid)) <= TOL


@pytest.mark.parametrize("grid", [(2, 32, 32), (2, 20, 28), (1, 18, 34)], ids=["448x448", "280x392", "252x476"])
def test_equals_transformers_at_3b_window_and_unaligned_mlp(grid):
    """random-3b's window (112 px = 4x4 merged tokens) and an MLP width that is not a multiple of
    128 (like 3b's 3420), at a small hidden size so the CPU stays fast."""
    config = tiny_config()
    vision = config.vision_config
    vision.window_size, vision.intermediate_size, vision.depth, vision.fullatt_block_indexes = 112, 90, 3, [1]
    loaded = model_from(config)
    tower = VisionTower(loaded)
    assert tower.blocks[0].down_weight.shape[1] == MLP_ALIGN
    assert loaded.model.model.visual.blocks[0].mlp.down_proj.in_features == 90  # the oracle is untouched
    pixels, _ = chunk(grid)
    (ours,) = tower([(pixels, grid)])
    assert max_diff(ours, reference(loaded, pixels, grid)) <= TOL


@pytest.mark.parametrize("change", ["one window per frame", "no full-attention layers"])
def test_comparison_is_sensitive_to_the_attention_pattern(loaded, change):
    """Negative control: attending across windows, or never across the frame, is far off."""
    tower = VisionTower(loaded)
    if change == "one window per frame":
        tower.window = 100
    else:
        tower.full_attention = frozenset()
    pixels, grid = chunk((2, 6, 10))
    assert max_diff(tower([(pixels, grid)])[0], reference(loaded, pixels, grid)) > 1e-3


def test_runtime_vision_batch_equals_vision_one_at_a_time(loaded):
    rt = Runtime(loaded)
    chunks = [chunk((2, 4, 6), 1), chunk((1, 6, 4), 2)]
    for (pixels, grid), ours in zip(chunks, rt.vision_batch(chunks), strict=True):
        assert max_diff(ours, rt.vision(pixels, grid)) <= 1e-6
    assert rt.vision_batch([]) == []


@pytest.mark.parametrize(
    ("pixels_shape", "grid"),
    [((48, 1176), (2, 4, 5)), ((47, 1176), (2, 4, 6)), ((48, 1000), (2, 4, 6)), ((0, 1176), (0, 4, 6))],
    ids=["odd-width", "too-few-rows", "wrong-patch-size", "no-frames"],
)
def test_bad_chunks_raise_a_clear_error(tower, pixels_shape, grid):
    with pytest.raises(FrameError, match="grid"):
        tower([chunk((2, 4, 6)), (torch.zeros(pixels_shape), grid)])


@pytest.mark.timeout(120)
def test_compiled_blocks_equal_eager(loaded, tower):
    """torch.compile traces our blocks (the eager backend: inductor's C++ build is too slow for a
    CPU test; the GPU runs inductor), over grids of different sizes and a mixed batch."""
    compiled = VisionTower(loaded, compile_backend="eager", compile_min_tokens=0)
    for chunks in ([chunk((2, 8, 8))], [chunk((2, 4, 6))], [chunk((2, 6, 10)), chunk((1, 8, 8), 1)]):
        for ours, eager in zip(compiled(chunks), tower(chunks), strict=True):
            assert max_diff(ours, eager) <= 1e-6


# -- GPU (skipped on CPU machines) -----------------------------------------------------------------------
def relative_error(a: torch.Tensor, truth: torch.Tensor) -> float:
    return ((a.float() - truth.float()).norm() / truth.float().norm()).item()


@pytest.fixture(scope="module")
def gpu_models() -> tuple[LoadedModel, LoadedModel]:
    """random-3b's vision tower (one text layer, to save memory) in fp32 and in bf16."""
    config = qwen3b_config()
    config.text_config.num_hidden_layers = 1
    fp32 = model_from(config, "cuda", torch.float32)
    bf16 = model_from(config, "cuda", torch.bfloat16)
    bf16.model.load_state_dict(fp32.model.state_dict())  # same weights, rounded to bf16
    return fp32, bf16


@needs_cuda
@pytest.mark.parametrize(
    "grids", [[(2, 32, 32)], [(2, 32, 32)] * 16, [(2, 32, 32), (2, 20, 28), (2, 16, 24), (1, 18, 34)]],
    ids=["448", "16x448", "mixed"],
)  # fmt: skip
def test_gpu_bf16_as_close_to_fp32_as_transformers(gpu_models, grids):
    """Against the fp32 tower as truth, our bf16 tower (reshape, varlen flash) errs no more than
    transformers' own bf16 tower does."""
    fp32, bf16 = gpu_models
    chunks = [chunk(g, seed, "cuda") for seed, g in enumerate(grids)]
    ours = VisionTower(bf16)(chunks)
    for (pixels, grid), mine in zip(chunks, ours, strict=True):
        truth = reference(fp32, pixels, grid)
        theirs = reference(bf16, pixels, grid)
        assert relative_error(mine, truth) <= max(2 * relative_error(theirs, truth), 1e-3)


@needs_cuda
def test_gpu_layer_loop_never_waits_on_the_host(gpu_models):
    _, bf16 = gpu_models
    tower = VisionTower(bf16)
    chunks = [chunk(g, seed, "cuda") for seed, g in enumerate([(2, 32, 32), (2, 20, 28)])]
    tower(chunks)  # builds and caches the plan
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tower(chunks)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.timeout(600)
def test_gpu_compiled_runtime_vision_equals_eager():
    eager = Runtime(load_model("tiny-random", device="cuda"), compile_vision=False)
    compiled = Runtime(eager.loaded, vision_compile_min_tokens=0)
    assert compiled.vision_tower.compiled
    chunks = [chunk(g, seed, "cuda") for seed, g in enumerate([(2, 8, 8), (2, 4, 6), (2, 6, 10)])]
    for mine, theirs in zip(compiled.vision_batch(chunks), eager.vision_batch(chunks), strict=True):
        assert relative_error(mine, theirs) <= 1e-2


@needs_cuda
@pytest.mark.timeout(600)
def test_gpu_vision_graphs_replay_what_the_compiled_layers_compute(monkeypatch):
    """A batch composition is launched layer by layer the first time, captured the second and
    replayed from then on, whatever order its chunks come in, with new pixels each time: exactly
    what the compiled layers compute launched one by one. Captured on a CUDA stream no other code
    gets from torch (so no other graph shares its cuBLAS workspace, see vision._TowerGraph)."""
    rt = Runtime(load_model("tiny-random", device="cuda"), vision_compile_min_tokens=0, vision_graphs=True)
    tower = rt.vision_tower
    grids = [(2, 8, 8), (2, 4, 6), (2, 8, 8)]

    def batch(seed: int, order: list[int]) -> list:
        return [chunk(grids[i], seed + i, "cuda") for i in order]

    tower(batch(0, [0, 1, 2]))
    assert not tower._graphs
    replayed = [tower(batch(1, [0, 1, 2])), tower(batch(2, [2, 0, 1])), tower(batch(3, [1, 2, 0]))]
    assert len(tower._graphs) == 1
    pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(64)}
    assert tower._capture_cuda_stream.cuda_stream not in pooled | {torch.cuda.default_stream().cuda_stream}
    monkeypatch.setattr(tower, "graphs", False)
    for seed, order, got in zip((1, 2, 3), ([0, 1, 2], [2, 0, 1], [1, 2, 0]), replayed, strict=True):
        for mine, theirs in zip(got, tower(batch(seed, order)), strict=True):
            assert torch.equal(mine, theirs)


@needs_cuda
@pytest.mark.timeout(600)
def test_gpu_a_vision_graph_captured_while_other_threads_use_the_legacy_stream_fails_nothing():
    """While serving, a new batch composition is captured while the stream threads copy frames
    from page-locked buffers and free them (an event recorded on the legacy default CUDA stream).
    On a blocking capture stream both failed ("operation would make the legacy stream depend on a
    capturing blocking stream"): chunks dead-lettered, the worker aborted (H200, 2026-11-29)."""
    import threading

    rt = Runtime(load_model("tiny-random", device="cuda"), vision_compile_min_tokens=0, vision_graphs=True)
    tower, stop, failures = rt.vision_tower, threading.Event(), []

    def copying() -> None:
        try:
            while not stop.is_set():
                frames = torch.randn(4, 3, 64, 64).pin_memory()
                frames.to("cuda", non_blocking=True).sum().item()
                del frames
        except Exception as e:
            failures.append(e)

    threads = [threading.Thread(target=copying, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for seed in range(4):  # the second time a composition comes, it is captured
            got = tower([chunk((2, 8, 8), seed, "cuda"), chunk((2, 4, 6), seed + 1, "cuda")])
        torch.cuda.synchronize()
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not failures, failures
    assert len(tower._graphs) == 1
    tower.graphs = False
    for mine, theirs in zip(got, tower([chunk((2, 8, 8), 3, "cuda"), chunk((2, 4, 6), 4, "cuda")]), strict=True):
        assert torch.equal(mine, theirs)
