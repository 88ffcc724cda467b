"""Restore micro-benchmark: heads read back from a real tmpfs segment store, as a worker taking
over a dead one's streams reads them (encoder_worker/restore.py); prints one JSON line per case.

It writes --streams heads of --gb-per-stream each, in segments of --segment-mb (a 4-frame chunk
of random-3b at 448x448 is 512 tokens x 36,864 bytes = 18.9 MB; a full 32K head is 1.2 GB), to a
`shm://` store of its own under /dev/shm (removed after), then restores them all, --at-once
streams at a time, for each case:

- `restorer`: the Restorer with N reader threads into its page-locked slots (--at-once of them),
  then each segment copied to --device from there, as the GPU loop copies it;
- `store_get`: what restoring did before the Restorer: each stream's segments read one after the
  other by its own thread (`SegmentStore.get`, page-locked on a GPU: cudaHostAlloc per segment).

Each of --checksums writes the heads anew with that checksum in their headers (`crc32c`, what
segments carry; `crc32`, zlib's, what they carried before 2026-11-29) and runs the cases on them:
the readers' code is the same, the function they check each byte with is the header's.

Reported: GB/s over all streams, each stream's time (p50, max), and, once, one core's rate of the
steps a reader runs per byte (tmpfs read, each checksum): what a number of readers can feed; last,
whether a head restored onto --device is bitwise what the store's own reader gives back.

    PYTHONPATH=. python scripts/bench_restore.py --streams 4 --gb-per-stream 0.6 --threads 1,2,4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import zlib
from concurrent import futures
from pathlib import Path

import crc32c
import numpy as np
import torch

from common import segment_store
from common.segment_store import DirectoryStore
from encoder_worker.restore import Restorer

LAYERS, KV_HEADS, HEAD_DIM = 36, 2, 128  # random-3b (Qwen2.5-VL 3B): 36,864 bytes a token in bf16
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--gb-per-stream", type=float, default=0.6, help="1.2 is a full 32K head")
    p.add_argument("--segment-mb", type=float, default=18.9)
    p.add_argument("--threads", default="1,2,4", help="reader threads of the restorer, one case each")
    p.add_argument("--at-once", type=int, default=4, help="streams restored at once")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=2, help="each case's best of this many")
    p.add_argument("--checksums", default="crc32c", help="crc32c (what segments carry), crc32 (before), or both")
    return p.parse_args(argv)


def write_heads(store: DirectoryStore, ns: argparse.Namespace) -> dict[str, list[str]]:
    """--streams heads of random bf16 K/V; stream -> its segment ids."""
    tokens = max(1, int(ns.segment_mb * 1e6 // TOKEN_BYTES))
    per_stream = max(1, round(ns.gb_per_stream * 1e9 / (tokens * TOKEN_BYTES)))
    kv = torch.randn(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM).to(torch.bfloat16)
    heads = {}
    for i in range(ns.streams):
        stream = f"cam{i:03d}"
        heads[stream] = [f"f{j:012d}" for j in range(per_stream)]
        for sid in heads[stream]:
            store.put(stream, sid, kv)
    return heads


def one_core_rates(store: DirectoryStore, stream: str, sid: str) -> dict[str, float]:
    """GB/s of one thread reading a segment from tmpfs into memory, and of each checksum over it."""
    with store.open(stream, sid) as (meta, f, _):
        buf = bytearray(meta["nbytes"])
        t0 = time.perf_counter()
        f.readinto(buf)
        read_s = time.perf_counter() - t0
    gb = len(buf) / 1e9
    rates = {"tmpfs_read_gb_per_s": round(gb / read_s, 2)}
    for name, fn in (("crc32", zlib.crc32), ("crc32c", crc32c.crc32c)):
        t0 = time.perf_counter()
        fn(buf)
        rates[f"{name}_gb_per_s"] = round(gb / (time.perf_counter() - t0), 2)
    return rates


def restore_all(read_one, heads: dict[str, list[str]], at_once: int) -> tuple[float, list[float]]:
    """Every head restored by `read_one(stream, ids)`, `at_once` streams at a time: total and per-stream seconds."""

    def timed(stream: str) -> float:
        t0 = time.perf_counter()
        read_one(stream, heads[stream])
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with futures.ThreadPoolExecutor(at_once) as pool:
        per_stream = list(pool.map(timed, heads))
    return time.perf_counter() - t0, per_stream


def case(name: str, read_one, heads: dict[str, list[str]], nbytes: int, ns: argparse.Namespace, **fields) -> dict:
    best = min((restore_all(read_one, heads, ns.at_once) for _ in range(ns.repeat)), key=lambda r: r[0])
    seconds, per_stream = best
    return {
        "case": name,
        **fields,
        "at_once": ns.at_once,
        "streams": len(heads),
        "gb": round(nbytes / 1e9, 3),
        "seconds": round(seconds, 3),
        "gb_per_s": round(nbytes / seconds / 1e9, 2),
        "per_stream_s": {"p50": round(float(np.median(per_stream)), 3), "max": round(max(per_stream), 3)},
    }


def restore(restorer: Restorer, store: DirectoryStore, stream: str, ids: list[str]) -> dict[str, torch.Tensor]:
    """A head read into a slot, then on the restorer's device, as the GPU loop copies it (then synced)."""
    loaded = restorer.load(store, stream, ids, [])
    try:
        on_device = {sid: loaded.to(t, restorer.device) for sid, t in loaded.kv.items()}
    finally:
        loaded.release()
    if restorer.device.type == "cuda":
        torch.cuda.synchronize(restorer.device)
    return on_device


def same_as_stored(store: DirectoryStore, stream: str, ids: list[str], ns: argparse.Namespace) -> bool:
    """The oracle: a head restored through a slot onto the device holds exactly the bytes the
    store's own reader gives back."""
    restorer = Restorer(torch.device(ns.device), 4, 1, slot_bytes(ns))
    try:
        on_device = restore(restorer, store, stream, ids)
    finally:
        restorer.close()
    stored = {sid: store.get(stream, sid).view(torch.uint8) for sid in ids}
    return all(torch.equal(on_device[sid].cpu().view(torch.uint8), stored[sid]) for sid in ids)


def slot_bytes(ns: argparse.Namespace) -> int:
    return int(ns.gb_per_stream * 1e9 * 1.15)  # the worker's slack (encoder_worker/service.py HEAD_SLACK)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    for name in ns.checksums.split(","):
        segment_store.WRITTEN_WITH = name
        root = Path(tempfile.mkdtemp(prefix="svqa-bench-restore-", dir="/dev/shm"))
        try:
            run_cases(DirectoryStore(root, durable=False), root, ns, name)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def run_cases(store: DirectoryStore, root: Path, ns: argparse.Namespace, checksum: str) -> None:
    device = torch.device(ns.device)
    heads = write_heads(store, ns)
    nbytes = sum(p.stat().st_size for p in root.rglob("*.seg"))
    first = next(iter(heads))
    one_core = one_core_rates(store, first, heads[first][0])
    print(json.dumps({"checksum": checksum, "one_core": one_core, "device": str(device)}))

    def store_get(stream: str, ids: list[str]) -> None:
        for sid in ids:
            store.get(stream, sid, device, pin=device.type == "cuda")

    print(json.dumps(case("store_get", store_get, heads, nbytes, ns, threads=1, checksum=checksum)))
    for threads in (int(t) for t in ns.threads.split(",")):
        restorer = Restorer(device, threads, ns.at_once, slot_bytes(ns))
        try:
            run = case(
                "restorer",
                lambda s, ids, r=restorer: restore(r, store, s, ids),
                heads,
                nbytes,
                ns,
                threads=threads,
                checksum=checksum,
            )
        finally:
            restorer.close()
        print(json.dumps(run), flush=True)
    print(json.dumps({"checksum": checksum, "bitwise_equal": same_as_stored(store, first, heads[first], ns)}))


if __name__ == "__main__":
    sys.exit(main())
