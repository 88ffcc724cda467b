"""Questions decoding beside encode steps, in the engine alone: ways of sharing the GPU's SMs.

The pipeline's load at 64 cameras and 8 askers without Redis or ingest: 8 streams get a 448x448
chunk (4 frames) each per encode step, from a feeder that always keeps one queued per stream,
while 8 askers on 8 other streams at 32K cached tokens ask for 32-token answers back to back,
all through one `Scheduler` as `streamvqa worker` runs it. For each way of sharing the SMs it
prints a JSON line: encode and decode ms a step, chunks/s, answer tokens/s, answer latency
p50/p95. Modes:
  encode    encode steps alone (no askers); `decode`: questions alone (no feeder)
  share     questions' steps on a high-priority CUDA stream (main as it is)
  sms:N     `decode_sms` N: while it keeps up, an encode step beside questions runs in a green
            context of all but N SMs (at fb17637 this script had `green:N` for that, without the
            keeping-up rule, and `sms:N` for the cuBLAS carveout `decode_sms` was then)
Run from the root of the code: `PYTHONPATH=. python3 scripts/probes/beside_encode.py [MODE ...]`;
`tiny-random cpu` as the first arguments: a smoke run of `share` on the CPU.
"""

import json
import sys
import threading
import time
from collections import deque

import numpy as np
import torch

from common.engine.answer import Generation
from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec
from common.engine.model import load_model
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.scheduler import SchedulePolicy, Scheduler
from common.engine.stream_engine import StreamEngine
from common.engine.warmup import warm_up
from common.logs import configure_logging

BUDGET = 32768
STREAMS = ASKERS = 8
SETTLE_S, MEASURE_S = 3.0, 10.0  # seconds


def fill(rt: Runtime, engines: list[StreamEngine], tokens: int) -> None:
    tpp = Grid(448, 448).tokens_per_patch
    for e in engines:
        seq = 0
        while e.head.tokens + 2 * tpp <= tokens:
            embeds = torch.zeros(2 * tpp, rt.lm.embed_tokens.embedding_dim, device=rt.device)
            e.append_embeddings(embeds, 2, (seq, seq + 3), (seq / 2, seq / 2 + 1.5))
            seq += 4


class Load:
    """The feeder and the askers, running until `stop`; what they saw, for a window."""

    def __init__(self, rt: Runtime, cams: list[StreamEngine], asked: list[StreamEngine]):
        self.rt, self.cams, self.asked = rt, cams, asked
        self.stop = threading.Event()
        self.frames = list(np.random.default_rng(0).integers(0, 256, (4, 448, 448, 3), dtype=np.uint8))
        self.chunks = 0
        self.answers: list[tuple[float, float, int]] = []  # (done at, latency, tokens)
        self.threads = [threading.Thread(target=self._feed, args=(e,), daemon=True) for e in cams]
        self.threads += [threading.Thread(target=self._ask, args=(e,), daemon=True) for e in asked]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _feed(self, engine: StreamEngine) -> None:
        """Two chunks queued at a time, so that every encode step finds one of each stream (a camera
        that has fallen behind has frames waiting)."""
        seq, queued = engine.head.last_frame_seq + 1, deque()
        while not self.stop.is_set():
            while len(queued) < 2:
                chunk = engine.prepare(self.frames, [(seq + i) / 2 for i in range(4)], range(seq, seq + 4))
                queued.append(engine.submit(chunk))
                seq += 4
            engine.finish(queued.popleft().result())
            self.chunks += 1
        for future in queued:
            engine.finish(future.result())

    def _ask(self, engine: StreamEngine) -> None:
        params = GenerationParams(max_tokens=32)
        while not self.stop.is_set():
            t0 = time.perf_counter()
            work = Generation(self.rt, engine.head, "What happens in the video?", params)
            got = self.rt.executor.submit(work).result()
            self.answers.append((time.perf_counter(), time.perf_counter() - t0, len(got.token_ids)))


def measure(rt: Runtime, mode: str, load: Load, steps: dict) -> dict:
    scheduler = rt.executor
    assert isinstance(scheduler, Scheduler)
    steps.clear()
    t0, chunks0 = time.perf_counter(), load.chunks
    time.sleep(MEASURE_S)
    spent = time.perf_counter() - t0
    window = [a for a in load.answers if a[0] >= t0]
    lat = sorted(a[1] for a in window)
    row = {"mode": mode, "seconds": round(spent, 1), "chunks_per_s": round((load.chunks - chunks0) / spent, 1)}
    for kind in ("encode", "decode"):
        times = steps.get(kind, [])
        row[f"{kind}_steps"] = len(times)
        row[f"{kind}_ms"] = round(1000 * sum(t for t, _ in times) / max(1, len(times)), 1)
        row[f"{kind}_units"] = round(sum(u for _, u in times) / max(1, len(times)), 1)
    row["answers"] = len(window)
    row["tokens_per_s"] = round(sum(a[2] for a in window) / spent, 1)
    if lat:
        row["latency_p50_s"] = round(lat[len(lat) // 2], 3)
        row["latency_p95_s"] = round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3)
    return row


def scheduler_for(mode: str, on_step) -> Scheduler:
    kind, _, n = mode.partition(":")
    if kind in ("share", "encode", "decode"):
        return Scheduler(SchedulePolicy(), on_step=on_step)
    if kind == "sms":
        return Scheduler(SchedulePolicy(decode_sms=int(n)), on_step=on_step)
    raise SystemExit(f"unknown mode {mode!r}")


def main() -> None:
    args = sys.argv[1:]
    model, device = ("tiny-random", "cpu") if args[:2] == ["tiny-random", "cpu"] else ("random-3b", "cuda")
    default = ["encode", "decode", "share", "sms:12", "sms:20", "sms:28"]
    modes = [a for a in args if a not in ("tiny-random", "cpu")] or default
    configure_logging("INFO")  # the engine's log lines on stderr: stdout is the JSON
    torch.set_num_threads(1)
    rt = Runtime(load_model(model, device=device), pool_tokens=1_200_000 if device == "cuda" else None)
    print(json.dumps({"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}), flush=True)
    if device == "cuda":
        print(json.dumps({"warm_up_s": round(warm_up(rt), 1)}), flush=True)
    spec = lambda name: StreamSpec(name, 2.0, Grid(448, 448), 4)  # noqa: E731
    policy = EvictionPolicy(max_cache_tokens=BUDGET)
    cams = [StreamEngine(rt, spec(f"cam{i}"), policy) for i in range(STREAMS)]
    asked = [StreamEngine(rt, spec(f"asked{i}"), policy) for i in range(ASKERS)]
    fill(rt, cams, 20_000 if device == "cuda" else 1_000)
    fill(rt, asked, BUDGET - 600 if device == "cuda" else 1_000)
    steps: dict[str, list[tuple[float, int]]] = {}

    def on_step(kind: str, seconds: float, units: int) -> None:
        steps.setdefault(kind, []).append((seconds, units))

    for mode in modes:
        try:
            scheduler = scheduler_for(mode, on_step)
        except Exception as e:  # a mode this machine cannot run (no green contexts, say)
            print(json.dumps({"mode": mode, "error": repr(e)}), flush=True)
            continue
        rt.executor = scheduler.start()
        load = Load(rt, [] if mode == "decode" else cams, [] if mode == "encode" else asked)
        load.start()
        time.sleep(SETTLE_S)
        print(json.dumps(measure(rt, mode, load, steps)), flush=True)
        load.stop.set()
        for t in load.threads:
            t.join(timeout=60)
        scheduler.stop()


if __name__ == "__main__":
    main()
