"""A chunk batch's prefill with every layer whole (`forward`) against the last layer stopping once
its K/V are written (`write_kv`, what encoding runs): prints JSON, per batch size, ms per chunk.

    PYTHONPATH=. python3 scripts/probes/write_kv_probe.py --streams 16 --tokens 32768

Each stream's next 512 tokens (a 448² chunk) are reserved and written again and again (the same
slots, nothing published), over caches filled with random embeddings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from common.engine.model import load_model
from common.engine.positions import text_positions
from common.engine.runtime import Runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, wherever it is run from
from bench_engine import filled_engines, timed

CHUNK_TOKENS = 512


def per_chunk_ms(rt: Runtime, engines: list) -> dict:
    lm, n = rt.lm, len(engines)
    items = [e.cache.reserve(CHUNK_TOKENS) for e in engines]
    embeds = torch.randn(n * CHUNK_TOKENS, lm.embed_tokens.embedding_dim, device="cuda", dtype=lm.dtype) * 0.02
    positions = torch.cat([text_positions(it.at, CHUNK_TOKENS) for it in items], dim=1).to("cuda")
    plan = lm.plan(items)
    whole = timed(lambda: lm.forward(embeds, positions, plan), repeat=10)
    kv_only = timed(lambda: lm.write_kv(embeds, positions, plan), repeat=10)
    return {"forward_ms_per_chunk": round(whole / n, 2), "write_kv_ms_per_chunk": round(kv_only / n, 2)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random-3b")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--batches", default="4,8,16")
    args = p.parse_args()
    rt = Runtime(load_model(args.model, device="cuda"), pool_tokens=2 * (args.tokens + 4096) * args.streams)
    engines = filled_engines(rt, args.streams, args.tokens)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for n in (int(b) for b in args.batches.split(",")):
        row = {"chunks": n, "cached_tokens": engines[0].head.tokens, **per_chunk_ms(rt, engines[:n])}
        print(json.dumps(row), file=sys.stderr, flush=True)
        out["rows"].append(row)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
