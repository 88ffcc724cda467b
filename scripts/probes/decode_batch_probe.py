"""Decode attention of several questions at once, each over its own long cache in one pool slab, as
a decode step runs it: prints JSON lines.

At 8 questions over 32K tokens a decode step's attention was 3.6 ms of its 6.6 (H200, bench_engine's
profile, 2026-11-27): 9.6 GB of K/V read at 2.7 TB/s of the H200's 4.8. This times
`decode_attention.piece_attention` and `combine` for R rows cut as lm.split_for cuts them (and
other splits), with tiles (`block_n` keys an iteration, `stages` loads in flight, `warps`) varied:
device microseconds a layer, replayed from a CUDA graph over 8 layers' caches in turn (past the L2
cache, as 36 layers are), the rate it reads K/V at, and the largest error against exact fp32
attention. Each row also gets its own ~40 keys as one more piece, as a decode row's own tokens are.
Needs a CUDA GPU:

    PYTHONPATH=. python3 scripts/probes/decode_batch_probe.py [--rows 1,4,8] [--tokens 32768]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

try:
    from common.engine import decode_attention
except ImportError:  # no Triton off the GPU machines: importing the probe still works, main says why not
    decode_attention = None

sys.path.insert(0, str(Path(__file__).parent))
from decode_attention_probe import replay_us

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 128
LAYERS = 8
OWN = 40  # a decode row's own keys (its question and answer so far)
SPLITS = {1: (32, 64, 128), 4: (16, 32, 64), 8: (8, 16, 32, 64), 32: (2, 4, 8, 16)}
TILES = ((64, 3, 4), (64, 4, 4), (64, 2, 4), (32, 4, 4), (128, 2, 4), (128, 2, 8), (64, 3, 8), (128, 3, 8))


def engine_split(rows: int, n_sm: int) -> int:
    """lm.LanguageModel.split_for's choice for one-row items over long bases."""
    from common.engine.lm import DECODE_BLOCKS_PER_SM, DECODE_MAX_SPLIT

    return max(1, min(DECODE_MAX_SPLIT, (DECODE_BLOCKS_PER_SM * n_sm) // (rows * KV_HEADS)))


def cut(rows: int, tokens: int, split: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(rows, starts, lengths) of every piece, split-major as lm.plan stacks them: piece s of every
    row, then piece s + 1; then each row's own keys (after all the bases in the slab)."""
    step = -(-tokens // split)
    host = [(r, r * tokens + s * step, max(0, min(step, tokens - s * step))) for s in range(split) for r in range(rows)]
    host += [(r, rows * tokens + r * OWN, OWN) for r in range(rows)]
    as_long = {"dtype": torch.long, "device": device}
    as_int = {"dtype": torch.int32, "device": device}
    return (
        torch.tensor([h[0] for h in host], **as_long),
        torch.tensor([h[1] for h in host] + [0], **as_int),
        torch.tensor([h[2] for h in host], **as_int),
    )


def attend(q: torch.Tensor, layer: torch.Tensor, pieces: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out, lse = decode_attention.piece_attention(q, layer, *pieces, HEAD_DIM**-0.5)
    return decode_attention.combine(out, lse, q.shape[0])


def exact(q: torch.Tensor, layer: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
    outs = []
    for r in range(rows):
        own = rows * tokens + r * OWN
        keys = torch.cat([torch.arange(r * tokens, (r + 1) * tokens), torch.arange(own, own + OWN)])
        k = layer[0][:, keys.to(layer.device)].float().repeat_interleave(HEADS // KV_HEADS, 0)  # (H, L, hd)
        v = layer[1][:, keys.to(layer.device)].float().repeat_interleave(HEADS // KV_HEADS, 0)
        scores = (q[r].float().unsqueeze(1) @ k.transpose(-1, -2)) * HEAD_DIM**-0.5  # (H, 1, L)
        outs.append((torch.softmax(scores, -1) @ v).squeeze(1))
    return torch.stack(outs)


def layers_in_turn(q, layers, pieces) -> None:
    for layer in layers:
        attend(q, layer, pieces)


def main() -> None:
    if decode_attention is None:
        raise SystemExit("this probe needs Triton (a GPU machine)")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,8,32")
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    device = torch.device("cuda")
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        slots = rows * (args.tokens + OWN)
        layers = torch.randn(LAYERS, 2, KV_HEADS, slots, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
        q = torch.randn(rows, HEADS, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
        truth = exact(q, layers[0], rows, args.tokens)
        kv_bytes = 2 * KV_HEADS * HEAD_DIM * 2 * (args.tokens + OWN) * rows  # one layer's K and V read
        chosen = engine_split(rows, n_sm)
        for split in sorted({chosen, *SPLITS.get(rows, (chosen,))}):
            pieces = cut(rows, args.tokens, split, device)
            for block_n, stages, warps in TILES:
                decode_attention.BLOCK_N, decode_attention.NUM_STAGES = block_n, stages
                decode_attention.NUM_WARPS = warps
                error = (attend(q, layers[0], pieces).float() - truth).abs().max().item()
                us = replay_us(functools.partial(layers_in_turn, q, layers, pieces)) / LAYERS
                row = {"rows": rows, "cache_tokens": args.tokens, "split": split, "engine_split": split == chosen}
                tile = {"block_n": block_n, "stages": stages, "warps": warps}
                rate = {"us_per_layer": round(us, 1), "tb_per_s": round(kv_bytes / us / 1e6, 2)}
                print(json.dumps({**row, **tile, **rate, "max_error": round(error, 5)}), flush=True)
        del layers


if __name__ == "__main__":
    main()
