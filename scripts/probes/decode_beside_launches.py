"""What frame decoding in a worker's threads costs the GPU loop's kernel launches (the GIL).

The encoder worker's stream threads decode their cameras' WebP frames (Pillow) while the GPU
loop launches kernels; every launch lets go of the GIL and takes it back. This times one small
CUDA launch (`a.add_(1)` on 16 floats) alone and while K threads decode 448x448 lossless WebP
frames back to back (K = 2, 4, 8), while 8 threads only `load()` them, and while 8 threads hand
the decodes to 8 processes; prints one JSON line (launch mean and p99 in us, frames decoded a
second). Run on the GPU machine:

    python3 scripts/probes/decode_beside_launches.py [GIL switch interval s, default 0.0005 as the worker]
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import PIL
import torch
from PIL import Image


def frame() -> bytes:
    """A 448x448 lossless WebP of gradients and noise, like the pipeline bench's video."""
    y, x = np.mgrid[0:448, 0:448]
    rgb = np.stack([(x + y) % 256, (2 * x) % 256, (3 * y) % 256], -1)
    rgb = (rgb + np.random.default_rng(0).integers(0, 8, rgb.shape)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="WEBP", lossless=True)
    return buf.getvalue()


WEBP = frame()


def decode(data: bytes = WEBP) -> bytes:
    """As common.wire.schemas decodes a frame."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")).tobytes()


def load_only() -> None:
    with Image.open(io.BytesIO(WEBP)) as im:
        im.load()


def launches(a: torch.Tensor, n: int) -> dict[str, float]:
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        a.add_(1)
        lat.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    lat.sort()
    return {"mean_us": round(sum(lat) / n * 1e6, 1), "p99_us": round(lat[int(n * 0.99)] * 1e6, 1)}


def beside(a: torch.Tensor, threads: int, work: Callable[[], object]) -> dict[str, float]:
    stop, done = threading.Event(), [0]

    def worker() -> None:
        while not stop.is_set():
            work()
            done[0] += 1

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    time.sleep(0.2)
    before, t0 = done[0], time.perf_counter()
    out = launches(a, 5000)
    out["frames_per_s"] = round((done[0] - before) / (time.perf_counter() - t0))
    stop.set()
    for t in pool:
        t.join()
    return out


def main() -> None:
    torch.set_num_threads(1)
    sys.setswitchinterval(float(sys.argv[1]) if len(sys.argv) > 1 else 0.0005)
    a = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    out: dict[str, object] = {"pillow": PIL.__version__, "switch_s": sys.getswitchinterval()}
    out["alone"] = launches(a, 20000)
    for k in (2, 4, 8):
        out[f"threads_{k}"] = beside(a, k, decode)
    out["threads_8_load_only"] = beside(a, 8, load_only)
    with ProcessPoolExecutor(8) as processes:
        list(processes.map(decode, [WEBP] * 16))
        out["threads_8_via_8_processes"] = beside(a, 8, lambda: processes.submit(decode, WEBP).result())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
