"""One decode row's attention over a long cache, three ways, one layer at random-3b's heads (16 query
heads on 2 KV heads, 128 wide); prints JSON lines (device microseconds a layer, replayed from a
CUDA graph as a decode step is, over 8 layers' caches in turn so that the L2 cache holds none,
and the largest error against exact fp32 attention).

- `swapped`, what the engine does today (lm._flash with one query row a piece): the base cut into
  `pieces` key ranges, the row copied once per piece; flash sees one query row a sequence and
  takes its own GQA path (it swaps the 8 query heads of a KV head in as rows, with copies of q,
  out and lse around the kernel) and its own split-KV kernel and combine; then our merge.
- `packed`: the 8 query heads of each KV head packed as 8 rows before the call (as lm._flash does
  for bases read by several rows), so flash runs its plain kernel, one thread block per piece and
  KV head, no swap, no split of its own, no combine; then our merge over more pieces.

- `triton`: common/engine/decode_attention.py, one program per piece and KV head reading the
  piece's keys once for the 8 query heads, no copies; then our merge. Its tile (`block_n` keys)
  and loads in flight (`stages`) are varied too.

Whether `packed` with enough pieces beats `swapped` says whether a decode step at 100K can lose
some of its 1.39 ms of split-KV kernel, 0.22 ms of combine and ~0.3 ms of copies a step (H200,
decode_step_probe, 2026-11-26). Needs a CUDA GPU:

    PYTHONPATH=. python3 scripts/probes/decode_attention_probe.py
"""

from __future__ import annotations

import functools
import json

import torch

try:
    from common.engine import decode_attention
except ImportError:  # no Triton off the GPU machines: importing the probe still works, main says why not
    decode_attention = None
from common.engine.lm import _merge_stacked

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 128
GROUP = HEADS // KV_HEADS
SIZES = (32768, 100000)
LAYERS = 8  # distinct layers' caches, in turn: together past the L2 cache (50 MB on an H200), as 36 are
LAYOUTS = {"swapped": (1, 8, 16, 32), "packed": (64, 128), "triton": (32, 64, 128, 256)}
TRITON_TILES = ((64, 3), (32, 3), (128, 2))  # (block_n, stages)


def pieces(length: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(starts (n + 1,), lengths (n,), max_k) of `length` keys cut into `n` ranges."""
    step = -(-length // n)
    starts = [p * step for p in range(n)]
    lengths = [max(0, min(step, length - s)) for s in starts]
    max_k = 1 << max(8, (step - 1).bit_length())
    as_int = {"dtype": torch.int32, "device": device}
    return torch.tensor([*starts, 0], **as_int), torch.tensor(lengths, **as_int), max_k


def attend(q: torch.Tensor, layer: torch.Tensor, cut: tuple, layout: str, merge) -> torch.Tensor:
    """q (1, H, hd) over every key of `layer` (2, kv_heads, L, hd), cut as `cut` (from `pieces`,
    made beforehand: a graph copies nothing from the host) -> (1, H, hd)."""
    starts, lengths, max_k = cut
    n = lengths.numel()
    if layout == "triton":
        out, lse = decode_attention.piece_attention(q, layer, _row_zero(n, q.device), starts, lengths, HEAD_DIM**-0.5)
        return merge(1, [(out, lse, None)])
    packed = layout == "packed"
    k, v = layer[0].transpose(0, 1), layer[1].transpose(0, 1)  # (slots, kv_heads, hd), read in place
    rows = GROUP if packed else 1
    if packed:  # (1, H, hd) -> (GROUP, kv_heads, hd): query head kv * GROUP + g is row g of KV head kv
        q = q.view(1, KV_HEADS, GROUP, HEAD_DIM).transpose(1, 2).reshape(GROUP, KV_HEADS, HEAD_DIM)
    q = q.repeat(n, 1, 1)
    cu_q = torch.arange(n + 1, dtype=torch.int32, device=q.device) * rows
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, starts, rows, max_k, 0.0, False, False, scale=HEAD_DIM**-0.5, seqused_k=lengths
    )[:2]
    if packed:  # back to (pieces, H, hd) and (pieces, H), as lm._flash does
        out = out.view(n, GROUP, KV_HEADS, HEAD_DIM).transpose(1, 2).reshape(n, HEADS, HEAD_DIM)
        lse = lse.view(KV_HEADS, n, GROUP).permute(1, 0, 2).reshape(n, HEADS)
    else:
        lse = lse.transpose(0, 1)
    return merge(1, [(out, lse, None)])


@functools.cache
def _row_zero(n: int, device: torch.device) -> torch.Tensor:
    """Every piece's query row: the one row (made once, outside the graphs)."""
    return torch.zeros(n, dtype=torch.long, device=device)


def exact(q: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    k = layer[0].float().repeat_interleave(GROUP, 0)  # (H, L, hd)
    v = layer[1].float().repeat_interleave(GROUP, 0)
    scores = (q.float().transpose(0, 1) @ k.transpose(-1, -2)) * HEAD_DIM**-0.5  # (H, 1, L)
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)  # (1, H, hd)


def layers_in_turn(q: torch.Tensor, layers: torch.Tensor, cut: tuple, layout: str, merge) -> None:
    for layer in layers:
        attend(q, layer, cut, layout, merge)


def replay_us(fn, n: int = 200) -> float:
    """Device microseconds of one call, from a CUDA graph replayed `n` times."""
    side_cuda_stream = torch.cuda.Stream()
    side_cuda_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_cuda_stream):
        fn()
    torch.cuda.current_stream().wait_stream(side_cuda_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(n):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / n * 1000


def main() -> None:
    if decode_attention is None:
        raise SystemExit("this probe needs Triton (a GPU machine)")
    device = torch.device("cuda")
    merge = torch.compile(_merge_stacked, dynamic=True)
    gen = torch.Generator(device=device).manual_seed(0)
    for length in SIZES:
        layers = torch.randn(LAYERS, 2, KV_HEADS, length, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
        layer = layers[0]
        q = torch.randn(1, HEADS, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
        truth = exact(q, layer)
        for layout, counts in LAYOUTS.items():
            for n in counts:
                for block_n, stages in TRITON_TILES if layout == "triton" else ((None, None),):
                    tile = {} if block_n is None else {"block_n": block_n, "stages": stages}
                    if tile:
                        decode_attention.BLOCK_N, decode_attention.NUM_STAGES = block_n, stages
                    cut = pieces(length, n, device)
                    got = attend(q, layer, cut, layout, merge)
                    us = replay_us(functools.partial(layers_in_turn, q, layers, cut, layout, merge)) / LAYERS
                    error = (got.float() - truth).abs().max().item()
                    row = {"cache_tokens": length, "layout": layout, "pieces": n, **tile, "us_per_layer": round(us, 1)}
                    print(json.dumps({**row, "max_error": round(error, 5)}), flush=True)


if __name__ == "__main__":
    main()
