"""Our own forward of Qwen2.5-VL's vision tower, batched over chunks of many streams.

transformers' tower (sdpa) attends window by window in a Python loop, with a host sync per
layer to split the sequence: thousands of tiny kernels per chunk. Here every layer is one
attention call over the whole batch. Tokens are kept in "window order" from the patch embed
to the merger (as transformers does), so each window, and each frame, is a contiguous run of
tokens that attends only to itself; one call attends all runs at once:

- all runs of one length (a grid that is a multiple of the window, or frames of one size):
  a reshape to (runs, heads, run_length, head_dim) and one SDPA call;
- runs of different lengths (edge windows, mixed grids in a batch): varlen flash attention
  over cu_seqlens on CUDA, elsewhere one SDPA call over runs padded to the longest, with a
  key mask.

Everything that depends on a grid (window permutation, rotary angles, run lengths) is
computed once per grid and cached, so the layer loop never waits on the host. The weights
are transformers' own modules; only the MLP gets a copy, with gate and up fused into one
matmul and its 3420 width zero-padded to a multiple of 128 (exact: padded units are
silu(0) * 0 = 0 and meet zero columns of the down projection; quantized to FP8, the zeros stay
zeros and no row's scale changes, fp8.py).

With `graphs` (the services' `gpu_vision_graphs`, on by default there; off for a bare
`Runtime`), a batch composition (its chunks' grids, in grid order whatever order they came in)
that comes a second time is captured as a CUDA graph and replayed from then on: one launch
instead of ~500 from Python. Engine alone the tower is device-bound either way; in a worker with
64 camera threads the GPU loop's Python waits for the GIL: a profiled encode step (the profiler
slows the host too) had the device idle 76 ms between the vision tower's kernels, for 35 ms of
work (H200). Replayed, encode steps of 7-8 chunks took 205-219 ms at 64 cameras against 226-231.
A replay has no layer boundaries, so no decode step is launched from inside it: decode steps
beside an encode step are launched from the prefill's layers.
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from common.engine.fp8 import Weight, cat_rows, linear, pad, warn_emulated, weight_of
from common.engine.grid import FrameError
from common.engine.interleave import between_layers, interleaved
from common.engine.lm import _rms_norm, tokens_vary
from common.engine.model import LoadedModel

GridTHW = tuple[int, int, int]
MLP_ALIGN = 128  # tensor-core friendly width for the padded MLP
COMPILED_MIN_TOKENS = 4096  # below this (two 448² chunks) compiled blocks lose: launch-bound (16.7 vs 21.5 ms at one)
BATCH_PLANS_KEPT = 64  # distinct batch compositions whose plans stay cached
CU_STREAM_NON_BLOCKING = 0x1  # cuda.h's flag: a stream that does not wait for the legacy default one
MAX_GRAPHS = 16  # batch compositions captured at most (never freed: see _TowerGraph); others launch layer by layer

log = structlog.get_logger()


@dataclass(frozen=True)
class GridPlan:
    """What one grid needs, on the device: tokens in window order and back, rotary angles."""

    perm: torch.Tensor  # (patches,) input row of each token in window order
    unmerge: torch.Tensor  # (merged,) window-order merged token of each output row
    cos: torch.Tensor  # (patches, head_dim) float32, window order
    sin: torch.Tensor
    window_lengths: tuple[int, ...]  # tokens per window, in window order
    frame_lengths: tuple[int, ...]  # tokens per temporal patch


class Runs:
    """Attention restricted to contiguous runs of tokens, as one call. Built once per batch
    composition from host-side lengths; `attend` then launches no host sync."""

    def __init__(self, lengths: Sequence[int], device: torch.device, varlen: bool):
        self.uniform = len(set(lengths)) == 1
        self.length = max(lengths)
        self.cu_seqlens = None
        self.gather = self.scatter = self.mask = None
        if self.uniform:
            return
        lens = torch.tensor(lengths)
        if varlen:
            self.cu_seqlens = F.pad(lens.cumsum(0), (1, 0)).to(device, torch.int32)
            return
        starts = lens.cumsum(0) - lens
        offset = torch.arange(self.length)
        valid = offset[None, :] < lens[:, None]  # (runs, longest)
        self.gather = torch.where(valid, starts[:, None] + offset, 0).to(device)
        self.scatter = (torch.arange(len(lengths))[:, None] * self.length + offset)[valid].to(device)
        self.mask = valid[:, None, None, :].to(device)  # keys of the run only, for every head and query

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v (tokens, heads, head_dim), possibly strided views -> (tokens, heads, head_dim)."""
        if self.cu_seqlens is not None:
            cu, longest = self.cu_seqlens, self.length  # no dropout, not causal, no debug mask
            out = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, longest, longest, 0.0, False, False, scale=scale
            )
            return out[0]
        n, heads, hd = q.shape
        if self.uniform:  # (runs, heads, length, head_dim) views, no copy
            q, k, v = (x.view(n // self.length, self.length, heads, hd).transpose(1, 2) for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
            return out.transpose(1, 2).reshape(n, heads, hd)
        q, k, v = (x[self.gather].transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale)
        return out.transpose(1, 2).reshape(-1, heads, hd)[self.scatter]


@dataclass(frozen=True)
class BatchPlan:
    """Several chunks as one token sequence: their grid plans concatenated. Rotary angles are
    concatenated per call instead of kept: at 64 chunks of 448² they would cost 84 MB a plan."""

    parts: tuple[GridPlan, ...]
    perm: torch.Tensor
    unmerge: torch.Tensor
    windows: Runs
    frames: Runs
    out_sizes: tuple[int, ...]  # merged tokens per chunk

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, 1, 1, head_dim) each: broadcast over q and k, and over heads."""
        if len(self.parts) == 1:
            cos, sin = self.parts[0].cos, self.parts[0].sin
        else:
            cos, sin = torch.cat([p.cos for p in self.parts]), torch.cat([p.sin for p in self.parts])
        return cos[:, None, None, :], sin[:, None, None, :]


@dataclass(frozen=True)
class _Block:
    """One block's weights: transformers' own tensors, the MLP fused and padded."""

    heads: int
    norm1: torch.nn.Module
    norm2: torch.nn.Module
    qkv: torch.nn.Module  # an nn.Linear, or an FP8Linear (fp8.py)
    proj: torch.nn.Module
    gate_up_weight: Weight  # (2 * padded, hidden): gate rows, then up rows
    gate_up_bias: torch.Tensor
    down_weight: Weight  # (hidden, padded)
    down_bias: torch.Tensor


def _padded_mlp(mlp: torch.nn.Module) -> tuple[Weight, torch.Tensor, Weight, torch.Tensor]:
    width = mlp.gate_proj.out_features
    extra = -width % MLP_ALIGN
    gate_up_w = cat_rows([pad(weight_of(mlp.gate_proj), rows=extra), pad(weight_of(mlp.up_proj), rows=extra)])
    gate_up_b = torch.cat([F.pad(mlp.gate_proj.bias, (0, extra)), F.pad(mlp.up_proj.bias, (0, extra))])
    return gate_up_w, gate_up_b, pad(weight_of(mlp.down_proj), cols=extra), mlp.down_proj.bias


class VisionTower:
    def __init__(
        self,
        loaded: LoadedModel,
        compile_backend: str | None = None,
        compile_min_tokens: int = COMPILED_MIN_TOKENS,
        graphs: bool = False,
        on_capture: Callable[[float], None] | None = None,
    ):
        """`compile_backend` ("inductor" on a GPU) compiles what surrounds the attention in a
        block (norms, projections, rotary, MLP): one graph each for every block and batch, used
        for batches of at least `compile_min_tokens` patches (smaller ones run eagerly). `graphs`:
        compiled batches are replayed from CUDA graphs (on a GPU); `on_capture(seconds)` after
        each graph captured (metrics)."""
        visual = loaded.model.model.visual
        cfg = loaded.vision_config
        if cfg.hidden_act != "silu":
            raise ValueError(f"vision MLP activation {cfg.hidden_act!r}: only silu is implemented")
        self.visual = visual
        self.device = loaded.device
        self.dtype = visual.dtype
        self.heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.merge = cfg.spatial_merge_size
        self.window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size  # in merged tokens
        self.full_attention = frozenset(cfg.fullatt_block_indexes)
        with torch.no_grad():
            self.patch_weight = visual.patch_embed.proj.weight.flatten(1)  # the Conv3d as a matmul (a view)
            self.blocks = [
                _Block(self.heads, b.norm1, b.norm2, b.attn.qkv, b.attn.proj, *_padded_mlp(b.mlp))
                for b in visual.blocks
            ]
        quantized = [
            w for b in self.blocks for w in (weight_of(b.qkv), weight_of(b.proj), b.gate_up_weight, b.down_weight)
        ]
        warn_emulated("vision tower", quantized, self.device)
        self.patch_dim = self.patch_weight.shape[1]
        self.varlen = (
            self.device.type == "cuda"
            and self.dtype in (torch.float16, torch.bfloat16)
            and torch.backends.cuda.is_flash_attention_available()
        )
        self._grid_plans: dict[GridTHW, GridPlan] = {}
        self._batch_plans: OrderedDict[tuple[GridTHW, ...], BatchPlan] = OrderedDict()
        self.graphs = graphs and self.device.type == "cuda"
        self._graphs: dict[tuple[GridTHW, ...], _TowerGraph] = {}
        self._capture_cuda_stream: torch.cuda.Stream | None = None  # and the graphs' shared memory pool,
        self._mempool = None  # both made with the first
        self.on_capture = on_capture
        self.compile_min_tokens = compile_min_tokens
        self._compiled = None
        if compile_backend:  # attention stays eager: its layouts vary with the batch, these shapes only in length
            # Only the token count varies (marked in __call__): with every size symbolic (dynamic=True)
            # inductor's kernels index with symbolic widths and ran at a fifth of the bandwidth.
            self._compiled = (
                torch.compile(_attention_input, backend=compile_backend),
                torch.compile(_output_and_mlp, backend=compile_backend),
            )

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    @torch.inference_mode()
    def __call__(self, chunks: Sequence[tuple[torch.Tensor, GridTHW]]) -> list[torch.Tensor]:
        """Chunks (pixels (t*h*w, C*tp*p*p), grid_thw in patches) -> each chunk's merged embeddings,
        as `visual(pixels, grid_thw)` gives them for that chunk alone."""
        if not chunks:
            return []
        grids = [self._check(pixels, grid) for pixels, grid in chunks]
        # in grid order: one plan, and one graph, per composition whatever order its chunks came in
        order = sorted(range(len(chunks)), key=grids.__getitem__)
        key = tuple(grids[i] for i in order)
        plan, seen = self._batch_plan(key)
        # to the device as they are, then cast there (a CPU-side cast would cost more than the copy)
        pixels = [chunks[i][0].to(self.device, non_blocking=True) for i in order]
        merged = self._merged(key, plan, pixels, seen)
        outs = dict(zip(order, merged[plan.unmerge].split(plan.out_sizes), strict=True))
        return [outs[i] for i in range(len(chunks))]

    def _merged(
        self, key: tuple[GridTHW, ...], plan: BatchPlan, pixels: list[torch.Tensor], seen: bool
    ) -> torch.Tensor:
        """The batch's merged tokens in window order: replayed from its graph where there is one,
        else launched layer by layer, compiled for batches of at least `compile_min_tokens`."""
        compiled = self._compiled is not None and plan.perm.numel() >= self.compile_min_tokens
        graph = self._graph(key, plan, seen) if compiled and self._graphable() else None
        if graph is not None:
            return graph.replay(pixels)
        fns = self._compiled if compiled else (_attention_input, _output_and_mlp)
        return self._forward(torch.cat(pixels).to(self.dtype), plan, fns)

    def _forward(self, pixels: torch.Tensor, plan: BatchPlan, fns: tuple[Callable, Callable]) -> torch.Tensor:
        attention_input, output_and_mlp = fns
        x = pixels[plan.perm] @ self.patch_weight.T
        cos, sin = plan.cos_sin()
        scale = self.head_dim**-0.5
        for i, block in enumerate(self.blocks):
            between_layers()
            runs = plan.frames if i in self.full_attention else plan.windows
            tokens_vary(x, cos, sin)
            q, k, v = attention_input(block, x, cos, sin)
            attended = runs.attend(q, k, v, scale)
            tokens_vary(attended)
            x = output_and_mlp(block, x, attended)
        merger = self.visual.merger
        return merger.mlp(_rms_norm(merger.ln_q, x).view(-1, merger.hidden_size))

    def _graphable(self) -> bool:
        """On the device's default CUDA stream only: an encode step that leaves SMs to questions runs on a
        green context's CUDA stream (scheduler.py), where replaying a graph has not been tried."""
        return self.graphs and torch.cuda.current_stream() == torch.cuda.default_stream()

    def _graph(self, key: tuple[GridTHW, ...], plan: BatchPlan, seen: bool) -> _TowerGraph | None:
        """The composition's graph, captured the second time it comes (a one-off batch is not worth
        a capture) while there are fewer than MAX_GRAPHS."""
        graph = self._graphs.get(key)
        if graph is None and seen and len(self._graphs) < MAX_GRAPHS:
            graph = self._capture(key, plan)
        return graph

    def _capture(self, key: tuple[GridTHW, ...], plan: BatchPlan) -> _TowerGraph:
        t0 = time.perf_counter()
        if self._capture_cuda_stream is None:
            self._capture_cuda_stream, self._mempool = _own_cuda_stream(self.device), torch.cuda.graph_pool_handle()
        with interleaved(_launch_nothing):  # no decode step may be launched into the capture
            graph = self._graphs[key] = _TowerGraph(self, plan, self._capture_cuda_stream, self._mempool)
        seconds = time.perf_counter() - t0
        if self.on_capture is not None:
            self.on_capture(seconds)
        log.info("vision graph captured", chunks=len(key), graphs=len(self._graphs), seconds=round(seconds, 2))
        return graph

    def _check(self, pixels: torch.Tensor, grid: Sequence[int]) -> GridTHW:
        t, h, w = (int(v) for v in grid)
        if t <= 0 or h <= 0 or w <= 0 or h % self.merge or w % self.merge:
            raise FrameError(f"grid_thw {tuple(grid)}: need positive sides, h and w multiples of {self.merge}")
        if tuple(pixels.shape) != (t * h * w, self.patch_dim):
            raise FrameError(
                f"pixels {tuple(pixels.shape)} do not match grid {t, h, w}: need {t * h * w, self.patch_dim}"
            )
        return t, h, w

    def _batch_plan(self, grids: tuple[GridTHW, ...]) -> tuple[BatchPlan, bool]:
        """The composition's plan, and whether it was cached (this composition came before)."""
        plan = self._batch_plans.get(grids)
        seen = plan is not None
        if plan is None:
            plan = self._build_batch_plan([self._grid_plan(g) for g in grids])
            self._batch_plans[grids] = plan
            if len(self._batch_plans) > BATCH_PLANS_KEPT:
                self._batch_plans.popitem(last=False)
        self._batch_plans.move_to_end(grids)
        return plan, seen

    def _build_batch_plan(self, plans: list[GridPlan]) -> BatchPlan:
        sizes = [p.perm.numel() for p in plans]
        out_sizes = [p.unmerge.numel() for p in plans]
        starts = [sum(sizes[:i]) for i in range(len(plans))]
        out_starts = [sum(out_sizes[:i]) for i in range(len(plans))]
        return BatchPlan(
            parts=tuple(plans),
            perm=torch.cat([p.perm + s for p, s in zip(plans, starts, strict=True)]),
            unmerge=torch.cat([p.unmerge + s for p, s in zip(plans, out_starts, strict=True)]),
            windows=Runs([n for p in plans for n in p.window_lengths], self.device, self.varlen),
            frames=Runs([n for p in plans for n in p.frame_lengths], self.device, self.varlen),
            out_sizes=tuple(out_sizes),
        )

    def _grid_plan(self, grid: GridTHW) -> GridPlan:
        plan = self._grid_plans.get(grid)
        if plan is None:
            plan = self._grid_plans[grid] = self._build_grid_plan(grid)
        return plan

    def _build_grid_plan(self, grid: GridTHW) -> GridPlan:
        t, h, w = grid
        unit = self.merge**2
        order, window_lengths = window_order(grid, self.merge, self.window)
        perm = (order[:, None] * unit + torch.arange(unit)).flatten()
        angles = self._rotary_angles(patch_positions(grid, self.merge)[perm].to(self.device))
        rotary = self.visual.rotary_pos_emb
        return GridPlan(
            perm=perm.to(self.device),
            unmerge=torch.argsort(order).to(self.device),
            cos=angles.cos() * rotary.attention_scaling,
            sin=angles.sin() * rotary.attention_scaling,
            window_lengths=tuple(n * unit for n in window_lengths),
            frame_lengths=(h * w,) * t,
        )

    def _rotary_angles(self, positions: torch.Tensor) -> torch.Tensor:
        """(tokens, 2) (row, col) -> (tokens, head_dim) angles: [rows | cols] frequencies, twice."""
        inv_freq = self.visual.rotary_pos_emb.inv_freq.to(self.device, torch.float32)
        half = (positions[..., None].float() * inv_freq).flatten(1)
        return torch.cat([half, half], dim=-1)


class _TowerGraph:
    """One batch composition's compiled forward as a CUDA graph: the chunks' pixels are copied
    into its input buffer, then one launch runs every layer.

    Captured on the tower's own CUDA stream: PyTorch gives matrix products a cuBLAS workspace per
    CUDA stream, and a graph keeps the one of the CUDA stream it was captured on. Captured on torch's
    default capture CUDA stream, as the question step graphs are, a vision graph and a decode step
    beside it (encode and decode steps overlap, see interleave.py) would write one workspace at
    once. (A CUDA stream from torch's pool for the warm-up could be that one too.) And a graph is never
    freed: freeing one frees its capture CUDA stream's workspace, which the tower's other graphs still
    use (pytorch/pytorch#193402)."""

    def __init__(self, tower: VisionTower, plan: BatchPlan, cuda_stream: torch.cuda.Stream, mempool):
        self.plan = plan  # its index tensors are the graph's
        self.pixels = torch.zeros(plan.perm.numel(), tower.patch_dim, dtype=tower.dtype, device=tower.device)
        # warm-up outside the graph (compilation, kernel selection), on the same CUDA stream: its matrix
        # products use the workspace only this tower's graphs do, after the last one's replay
        cuda_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(cuda_stream):
            tower._forward(self.pixels, plan, tower._compiled)
        torch.cuda.current_stream().wait_stream(cuda_stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool, stream=cuda_stream, capture_error_mode="thread_local"):
            self.out = tower._forward(self.pixels, plan, tower._compiled)

    def replay(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        """The merged tokens (the graph's own output: read them before the next replay)."""
        at = 0
        for p in pixels:  # cast as copied, as `.to(dtype)` would
            self.pixels[at : at + p.shape[0]].copy_(p)
            at += p.shape[0]
        self.graph.replay()
        return self.out


def _own_cuda_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A CUDA stream on `device` that no other code uses: `torch.cuda.Stream()` hands out CUDA streams
    of a pool of 32 round-robin, so one taken there may be another's (the question graphs' capture
    CUDA stream). Non-blocking, as torch's are: while a blocking one captures, anything another
    thread puts on the legacy default CUDA stream (a page-locked buffer freed, its event recorded)
    fails, "operation would make the legacy stream depend on a capturing blocking stream": a
    capture while serving dead-lettered 56 cameras' chunks and aborted the worker (H200,
    2026-11-29). Ordering is explicit (`wait_stream`) wherever the stream is used."""
    raw = ctypes.c_void_p()
    with torch.cuda.device(device):  # the driver's call creates it in the context current here
        torch.cuda.current_stream().query()  # a runtime call: the device's context is current
        result = ctypes.CDLL("libcuda.so.1").cuStreamCreate(ctypes.byref(raw), CU_STREAM_NON_BLOCKING)
    if result != 0:
        raise RuntimeError(f"cuStreamCreate failed (CUresult {result})")
    return torch.cuda.ExternalStream(raw.value, device=device)


def _launch_nothing() -> None:
    """The interleaving hook while a graph is captured: nothing runs between its layers."""


def _attention_input(block: _Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Norm, qkv projection and rotary: (tokens, hidden) -> q, k, v (tokens, heads, head_dim)."""
    qkv = linear(_rms_norm(block.norm1, x), weight_of(block.qkv), block.qkv.bias).view(x.shape[0], 3, block.heads, -1)
    q, k = _rotate(qkv[:, :2], cos, sin).unbind(1)
    return q, k, qkv[:, 2]


def _output_and_mlp(block: _Block, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    x = x + block.proj(attended.reshape(x.shape))
    gate, up = linear(_rms_norm(block.norm2, x), block.gate_up_weight, block.gate_up_bias).chunk(2, dim=-1)
    return x + linear(F.silu(gate, inplace=True).mul_(up), block.down_weight, block.down_bias)


def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in float32, cast back (as transformers' apply_rotary_pos_emb_vision).
    In place where it can: at 64 chunks of 448² each float32 copy of q and k is 1.3 GB."""
    x = qk.float()  # qk itself when already float32: overwriting it is fine, nothing reads it again
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1).mul_(sin)
    return x.mul_(cos).add_(rotated).to(qk.dtype)


def window_order(grid: GridTHW, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Merged tokens of a grid in window order (frame by frame, windows row-major, tokens
    row-major inside a window; edge windows are cut short) and each window's token count."""
    t, h, w = grid
    rows, cols = h // merge, w // merge
    pad_r, pad_c = -rows % window, -cols % window
    index = F.pad(torch.arange(t * rows * cols).view(t, rows, cols), (0, pad_c, 0, pad_r), value=-1)
    n_r, n_c = (rows + pad_r) // window, (cols + pad_c) // window
    index = index.view(t, n_r, window, n_c, window).transpose(2, 3).reshape(t * n_r * n_c, window * window)
    valid = index >= 0
    return index[valid], valid.sum(1).tolist()


def patch_positions(grid: GridTHW, merge: int) -> torch.Tensor:
    """(t*h*w, 2) (row, col) of every patch, in the input order (merge blocks row-major)."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    blocks = [p.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten() for p in (rows, cols)]
    return torch.stack(blocks, dim=-1).repeat(t, 1)
