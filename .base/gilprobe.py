import io, sys, threading, time, json
import numpy as np, torch, PIL
from PIL import Image
torch.set_num_threads(1)
rng = np.random.default_rng(0)
# a frame like the bench's generated video: smooth gradients plus noise
y, x = np.mgrid[0:448, 0:448]
rgb = np.stack([(x + y) % 256, (2 * x) % 256, (3 * y) % 256], -1).astype(np.uint8)
rgb = (rgb + rng.integers(0, 8, rgb.shape)).astype(np.uint8)
buf = io.BytesIO(); Image.fromarray(rgb).save(buf, format="WEBP", lossless=True); webp = buf.getvalue()
def dec():
    with Image.open(io.BytesIO(webp)) as im:
        return np.asarray(im.convert("RGB")).tobytes()
t = time.perf_counter(); [dec() for _ in range(20)]; dms = (time.perf_counter() - t) / 20 * 1e3
dev = torch.device("cuda"); a = torch.zeros(16, device=dev); torch.cuda.synchronize()
def ops(n):
    lat = []
    for _ in range(n):
        t = time.perf_counter(); a.add_(1); lat.append(time.perf_counter() - t)
    torch.cuda.synchronize(); lat.sort()
    return {"mean_us": round(sum(lat) / n * 1e6, 1), "p99_us": round(lat[int(n * 0.99)] * 1e6, 1), "max_ms": round(lat[-1] * 1e3, 2)}
out = {"pil": PIL.__version__, "webp_kb": len(webp) // 1024, "decode_ms": round(dms, 2), "alone": ops(20000)}
for k in (1, 8, 16):
    stop = False
    def worker():
        while not stop: dec()
    ws = [threading.Thread(target=worker) for _ in range(k)]; [w.start() for w in ws]; time.sleep(0.2)
    out[f"with_{k}_decoders"] = ops(5000)
    stop = True; [w.join() for w in ws]
print(json.dumps(out))
