import io, sys, threading, time, json
from concurrent.futures import ProcessPoolExecutor
import numpy as np, torch, PIL
from PIL import Image
torch.set_num_threads(1)
sys.setswitchinterval(float(sys.argv[1]))
rng = np.random.default_rng(0)
y, x = np.mgrid[0:448, 0:448]
rgb = np.stack([(x + y) % 256, (2 * x) % 256, (3 * y) % 256], -1).astype(np.uint8)
rgb = (rgb + rng.integers(0, 8, rgb.shape)).astype(np.uint8)
buf = io.BytesIO(); Image.fromarray(rgb).save(buf, format="WEBP", lossless=True); webp = buf.getvalue()
def dec(data=webp):
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB")).tobytes()
def load_only():
    with Image.open(io.BytesIO(webp)) as im:
        im.load()
dev = torch.device("cuda"); a = torch.zeros(16, device=dev); torch.cuda.synchronize()
def ops(n):
    lat = []
    for _ in range(n):
        t = time.perf_counter(); a.add_(1); lat.append(time.perf_counter() - t)
    torch.cuda.synchronize(); lat.sort()
    return {"mean_us": round(sum(lat) / n * 1e6, 1), "p99_us": round(lat[int(n * 0.99)] * 1e6, 1)}
def with_threads(k, fn):
    stop = False; count = [0]
    def worker():
        while not stop: fn(); count[0] += 1
    ws = [threading.Thread(target=worker) for _ in range(k)]; [w.start() for w in ws]; time.sleep(0.2)
    c0, t0 = count[0], time.perf_counter(); r = ops(5000); r["frames_per_s"] = round((count[0] - c0) / (time.perf_counter() - t0))
    stop = True; [w.join() for w in ws]
    return r
def dec_bytes():
    with Image.open(io.BytesIO(webp)) as im:
        im.load()
        assert im.mode == "RGB"
        return im.tobytes()
out = {"switch": sys.getswitchinterval(), "alone": ops(20000)}
for k in (2, 4, 8):
    out[f"threads_{k}"] = with_threads(k, dec)
out["threads_8_tobytes"] = with_threads(8, dec_bytes)
out["threads_8_load_only"] = with_threads(8, load_only)
pool = ProcessPoolExecutor(8)
list(pool.map(dec, [webp] * 16))
def via_pool():
    pool.submit(dec, webp).result()
out["threads_8_via_8_processes"] = with_threads(8, via_pool)
print(json.dumps(out))
