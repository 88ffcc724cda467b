"""How fast can the GPU read segments straight out of the shared-memory store? (issue 36: a killed
worker's 64 heads, 77 GB, back within 3 s needs about 26 GB/s; the restorer's CPU readers, which
copy each segment into page-locked slots and check it on the way, reach 18.8 on an H200 host.)

Writes --files files of --file-mb each to a directory under /dev/shm (as tmpfs segments lie),
maps each (MAP_SHARED, read-only) and measures, over all of them:

- `pageable`: `tensor.to(device)` straight from the mapping, with --threads threads at once (the
  driver stages pageable memory through page-locked buffers of its own);
- `register`: `cudaHostRegister` of each mapping (the pages pinned and mapped for the device's DMA;
  read-only, as a survivor maps another worker's files), then `to(device, non_blocking=True)`
  from the registered mapping on one stream, then `cudaHostUnregister`: each step's GB/s.

Each copy is checked on the device against the file's bytes (a sum of its int32 words there and
here). Prints one JSON line. Measured on an H200 host (16 cores, 2026-11-29, 64 files of 256 MB):
pageable copies 2.3-2.5 GB/s with 8 or 16 threads; registering 13 GB/s (one thread), the copy from
registered pages 55 GB/s, unregistering 140 GB/s. Run from the root of the code on a GPU:
`PYTHONPATH=. python3 scripts/probes/shm_to_gpu.py --files 64 --file-mb 256`.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import numpy as np
import torch

REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the mapping is read-only


def write_files(root: Path, n: int, nbytes: int) -> list[Path]:
    block = np.random.default_rng(0).integers(0, 2**31, nbytes // 4, dtype=np.int32)
    paths = []
    for i in range(n):
        block[0] = i  # no two alike
        path = root / f"{i:04d}.seg"
        path.write_bytes(block.tobytes())
        paths.append(path)
    return paths


def mapped(path: Path) -> tuple[mmap.mmap, torch.Tensor]:
    with path.open("rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    return m, torch.frombuffer(m, dtype=torch.uint8)


def word_sum(t: torch.Tensor) -> int:
    return int(t.view(torch.int32).to(torch.int64).sum())


def pageable(paths: list[Path], device: torch.device, threads: int) -> tuple[float, bool]:
    def one(path: Path) -> bool:
        m, host = mapped(path)
        with torch.cuda.stream(torch.cuda.Stream(device)):  # a stream a copy: the threads' copies overlap
            on_device = host.to(device)
            torch.cuda.current_stream(device).synchronize()
        same = word_sum(on_device) == word_sum(host)
        del host
        m.close()
        return same

    t0 = time.perf_counter()
    with futures.ThreadPoolExecutor(threads) as pool:
        same = all(pool.map(one, paths))
    return time.perf_counter() - t0, same


def registered(paths: list[Path], device: torch.device) -> dict[str, float | bool]:
    cudart = torch.cuda.cudart()
    maps = [mapped(p) for p in paths]
    t0 = time.perf_counter()
    for _, host in maps:
        err = cudart.cudaHostRegister(host.data_ptr(), host.numel(), REGISTER_READ_ONLY)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: error {int(err)}")
    t1 = time.perf_counter()
    on_device = [host.to(device, non_blocking=True) for _, host in maps]
    torch.cuda.current_stream(device).synchronize()
    t2 = time.perf_counter()
    same = all(word_sum(d) == word_sum(h) for d, (_, h) in zip(on_device, maps, strict=True))
    pinned = all(h.is_pinned() for _, h in maps)
    t3 = time.perf_counter()
    for _, host in maps:
        cudart.cudaHostUnregister(host.data_ptr())
    t4 = time.perf_counter()
    for m, host in maps:
        del host
        m.close()
    return {"register_s": t1 - t0, "copy_s": t2 - t1, "unregister_s": t4 - t3, "bitwise": same, "is_pinned": pinned}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--file-mb", type=int, default=256)
    p.add_argument("--threads", type=int, default=8)
    ns = p.parse_args(argv)
    device = torch.device("cuda")
    root = Path(tempfile.mkdtemp(prefix="svqa-shm-probe-", dir="/dev/shm"))
    try:
        paths = write_files(root, ns.files, ns.file_mb << 20)
        gb = ns.files * (ns.file_mb << 20) / 1e9
        torch.empty(1, device=device)  # the context, outside the timings
        pageable_s, pageable_same = pageable(paths, device, ns.threads)
        reg = registered(paths, device)
        out = {
            "gb": round(gb, 2),
            "files": ns.files,
            "cores": os.cpu_count(),
            "pageable": {"threads": ns.threads, "gb_per_s": round(gb / pageable_s, 2), "bitwise": pageable_same},
            "registered": {
                "register_gb_per_s": round(gb / reg["register_s"], 2),
                "copy_gb_per_s": round(gb / reg["copy_s"], 2),
                "unregister_gb_per_s": round(gb / reg["unregister_s"], 2),
                "bitwise": reg["bitwise"],
                "is_pinned": reg["is_pinned"],
            },
            "device": torch.cuda.get_device_name(device),
        }
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
