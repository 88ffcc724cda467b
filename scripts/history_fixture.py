"""The past a pipeline benchmark asks about, written before its services start (bench_pipeline.py
`--history-askers`, `--retrieval-askers`, `--search-clients`): every camera's frames log over the
last `log_hours` and its search index over the last `index_hours`, both ending now, made with the
project's own writers as a recorder that had run that long would have left them. Recording an hour
live would take an hour; a benchmark call has 10 minutes.

- **Frames.** The video the cameras play, sampled at their fps by ingest's own sampler
  (`iter_file_frames`) and encoded as ingest encodes a frame (`encode_frame`, ingest's default
  `frame_codec`). Its first `DISTINCT_FRAMES` are encoded (compressing 7,200 frames a camera-hour
  would take longer than the benchmark) and played in a loop; each record is its frame's payload
  stamped with its own seq, capture time and pts (`stamped`: byte for byte what `encode_frame`
  gives for that frame at that seq and time). They are written by the log's writer
  (`FrameLog.writer`), a file per `framelog_roll_s` of capture time, as the recorder rolls them.
- **Vectors.** Random, each layer's part at unit length, float16 of the model's real size (its
  feature layers x KV heads x head dim): a search's time depends on their number and size far
  more than on what they mean (random vectors are, if anything, the graph's hard case), and
  random weights rank nothing anyway. One a chunk of `chunk_frames` frames; the chunks of the
  logged hours are exactly the logged frames (a retrieval reads them back). Building the HNSW
  graph of a camera-day takes long (43,200 vectors of 1,024: 6 minutes on a loaded 2-core
  machine), so one camera's index is built (`ChunkIndex.extend`, all cores) and saved, and every
  other camera gets a copy of its two files: each camera's search does the same work on its own
  copy.

Seqs count from 0 at the start of the past; the live cameras' start at 0 again after it (a fresh
Redis knows nothing of the log), so the one chunk of the log across the join has descending seqs
and is not read back (a history answer leaves it out). Capture times are unix seconds, the last
frame 1/fps before the fixture's `now`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from common.chunkindex import GRAPH_NAME, META_NAME, ChunkIndex
from common.framelog import FrameLog
from common.wire.feature_record import ChunkFeatures
from common.wire.schemas import FIELD, FrameMsg, encode_frame
from ingest.config import IngestConfig
from ingest.video import iter_file_frames
from recorder.config import RecorderConfig

REPO = Path(__file__).resolve().parents[1]
DISTINCT_FRAMES = 120  # a minute of the video at 2 fps, played in a loop
ROLL_S = RecorderConfig.framelog_roll_s  # capture time a log file holds, as the recorder rolls them
WRITERS = 8  # cameras' logs written at once (the writes and crc32 release the GIL)
SEED = 0


@dataclass(frozen=True)
class Past:
    """What the fixture writes: capture times and seqs of the past's frames (seq i at ts[i])."""

    fps: float
    chunk_frames: int
    ts: np.ndarray  # float64 unix seconds, one a frame, oldest first
    log_frames: int  # the last this many frames are in the log
    index_chunks: int  # the last this many chunks are in the index

    @classmethod
    def ending(cls, now: float, fps: float, chunk_frames: int, log_hours: float, index_hours: float) -> Past:
        def whole_chunks(hours: float) -> int:
            return int(hours * 3600 * fps) // chunk_frames

        n = max(whole_chunks(log_hours), whole_chunks(index_hours)) * chunk_frames
        ts = now - (n - np.arange(n)) / fps
        return cls(fps, chunk_frames, ts, whole_chunks(log_hours) * chunk_frames, whole_chunks(index_hours))

    def logged(self) -> range:
        return range(len(self.ts) - self.log_frames, len(self.ts))

    def chunks(self) -> range:
        """The first seq of each indexed chunk."""
        return range(len(self.ts) - self.index_chunks * self.chunk_frames, len(self.ts), self.chunk_frames)


def stamped(m: dict[str, Any], seq: int, ts: float, pts: float) -> bytes:
    """A frame's unpacked payload (`encode_frame`'s ``m``) packed again as that frame at another
    seq and time: its pixels as encoded, not compressed again."""
    return msgpack.packb({**m, "seq": int(seq), "ts": float(ts), "pts": float(pts)}, use_bin_type=True)


def frame_payloads(video: str, fps: float, n: int = DISTINCT_FRAMES) -> list[bytes]:
    """The first ``n`` frames the cameras publish of ``video`` (fewer if it is shorter), as ingest
    encodes them."""
    codec = IngestConfig.frame_codec
    out = []
    for frame in iter_file_frames(video, fps):
        msg = FrameMsg.from_rgb(frame.index, frame.pts, frame.pts, frame.rgb, frame.epoch)
        out.append(encode_frame(msg, codec=codec)[FIELD])
        if len(out) == n:
            break
    return out


def write_log(root: Path, cam: str, past: Past, payloads: Sequence[bytes]) -> int:
    """The camera's logged frames, a file per ROLL_S of capture time; the bytes written."""
    maps = [msgpack.unpackb(p, raw=False) for p in payloads]
    per_file = max(1, int(ROLL_S * past.fps))
    seqs = past.logged()
    # A writer rolls at the first append after a commit once `roll_s` of wall time has passed
    # since its file began: with a tiny one, each commit (a file's frames) starts a file.
    writer = FrameLog(root).writer(cam, roll_s=1e-6)
    written = 0
    try:
        for start in range(seqs.start, seqs.stop, per_file):
            for seq in range(start, min(start + per_file, seqs.stop)):
                ts = float(past.ts[seq])
                writer.append(seq, ts, stamped(maps[seq % len(maps)], seq, ts, seq / past.fps))
            written += writer.commit()
            time.sleep(1e-3)  # the next file's name (its start, in ms) comes after this one's
    finally:
        writer.close()
    return written


def feature_shape(model: str) -> tuple[tuple[int, ...], int]:
    """The layers a chunk's vector is taken at and its size, from the model's config alone
    (the workers hold the model): what the encoder publishes (common/engine/features.py)."""
    from common.engine.features import feature_layers
    from common.engine.model import qwen3b_config, tiny_config
    from common.engine.names import RANDOM_MODELS

    if model in RANDOM_MODELS:
        config = (tiny_config() if model == "tiny-random" else qwen3b_config()).text_config
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model).text_config
    head_dim = config.hidden_size // config.num_attention_heads  # as the engine's (lm.py)
    layers = feature_layers(config.num_hidden_layers)
    return layers, len(layers) * config.num_key_value_heads * head_dim


def random_vectors(n: int, layers: int, dim: int, seed: int = SEED) -> np.ndarray:
    """(n, dim) float16, each layer's part at unit length (as the encoder's are)."""
    v = np.random.default_rng(seed).standard_normal((n, layers, dim // layers), dtype=np.float32)
    return (v / np.linalg.norm(v, axis=2, keepdims=True)).reshape(n, dim).astype(np.float16)


def build_index(d: Path, past: Past, model: str) -> ChunkIndex:
    """One camera's index of the past's chunks, saved in ``d``."""
    layers, dim = feature_shape(model)
    firsts = past.chunks()
    vectors = random_vectors(len(firsts), len(layers), dim)
    n, ts = past.chunk_frames, past.ts
    index = ChunkIndex(model, layers, dim)
    chunks = [
        ChunkFeatures((float(ts[s]), float(ts[s + n - 1])), (s, s + n - 1), n, model, layers, v)
        for s, v in zip(firsts, vectors, strict=True)
    ]
    index.extend(chunks)
    d.mkdir(parents=True, exist_ok=True)
    index.save(d)
    return index


def prefill(
    root: Path, cameras: list[str], video: str, model: str, past: Past, workers: int = WRITERS
) -> dict[str, Any]:
    """Every camera's log and index of ``past`` under ``root`` (the recorder's framelog_dir);
    what was written and how long it took."""
    t0 = time.monotonic()
    payloads = frame_payloads(video, past.fps) if past.log_frames else []
    encoded_s = time.monotonic() - t0
    with ThreadPoolExecutor(workers) as pool:
        logs = pool.map(lambda cam: write_log(root, cam, past, payloads), cameras) if payloads else iter(())
        index = build_index(root / cameras[0], past, model) if past.index_chunks else None
        for cam in cameras[1:] if index is not None else ():
            (root / cam).mkdir(parents=True, exist_ok=True)
            for name in (GRAPH_NAME, META_NAME):
                shutil.copyfile(root / cameras[0] / name, root / cam / name)
        log_bytes = sum(logs)
    layers, dim = feature_shape(model)
    return {
        "seconds": round(time.monotonic() - t0, 2),
        "encode_frames_s": round(encoded_s, 2),
        "cameras": len(cameras),
        "log_hours": round(past.log_frames / past.fps / 3600, 4),
        "index_hours": round(past.index_chunks * past.chunk_frames / past.fps / 3600, 4),
        "frames_per_camera": past.log_frames,
        "distinct_frames": len(payloads),
        "log_bytes": log_bytes,
        "chunks_per_camera": past.index_chunks,
        "vectors": f"random, unit float16 (timing only): {dim} = {len(layers)} layers x KV heads x head dim",
        "ended_at": round(float(past.ts[-1]), 3) if len(past.ts) else None,
    }


# --------------------------------------------------------------------------- what the index costs


def index_usage(root: Path, cameras: list[str], fps: float, chunk_frames: int, pids: dict[str, int]) -> dict:
    """The cameras' search indexes now: chunks, camera-hours and disk bytes; the memory one
    camera's takes held to be added to, as the recorder holds each camera's (`held_bytes`); and
    per process in ``pids`` (the workers, whose search process maps every camera's graph to
    search it) the bytes of index files it and its descendants map and hold resident."""
    chunks = disk = 0
    for cam in cameras:
        index = ChunkIndex.view(root / cam)
        chunks += len(index) if index is not None else 0
        disk += sum(p.stat().st_size for p in (root / cam / GRAPH_NAME, root / cam / META_NAME) if p.exists())
    hours = chunks * chunk_frames / fps / 3600
    one = ChunkIndex.view(root / cameras[0])
    one_hours = len(one) * chunk_frames / fps / 3600 if one is not None else 0.0
    mapped = {name: mapped_bytes(pid, GRAPH_NAME) for name, pid in pids.items()}
    return {
        "chunks": chunks,
        "camera_hours": round(hours, 3),
        "disk_bytes": disk,
        "disk_bytes_per_camera_hour": _per_hour(disk, hours),
        "held_bytes_per_camera_hour": _per_hour(held_bytes(root / cameras[0]), one_hours) if one_hours else None,
        "mapped": {
            name: {**m, "resident_bytes_per_camera_hour": _per_hour(m["resident_bytes"], hours)}
            for name, m in mapped.items()
        },
    }


def _per_hour(nbytes: int, hours: float) -> int | None:
    return round(nbytes / hours) if hours else None


def held_bytes(d: Path) -> int:
    """Resident bytes the index in ``d`` takes in a process that opens it to add to it, as the
    recorder does (the graph and its rows in the heap): a fresh interpreter's, before and after."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run(
        [sys.executable, "-c", _HELD, str(d)], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    if out.returncode != 0:
        raise RuntimeError(f"opening the index in {d} failed: {out.stderr[-500:]}")
    return int(out.stdout)


_HELD = """
import sys
from pathlib import Path
from common.chunkindex import ChunkIndex
from scripts.history_fixture import resident
before = resident()
index = ChunkIndex.open(Path(sys.argv[1]))
print(resident() - before)
"""


def resident() -> int:
    """This process's resident bytes (/proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mapped_bytes(pid: int, suffix: str) -> dict[str, int]:
    """Size and resident bytes of the mappings of files named ``suffix`` by the process and its
    descendants (a worker's indexes are mapped by its search process, qa_worker/index_process.py)."""
    found = {"Size:": 0, "Rss:": 0}
    for one in [pid, *descendants(pid)]:
        try:
            lines = Path(f"/proc/{one}/smaps").read_text().splitlines()
        except OSError:  # not Linux, or gone meanwhile
            lines = []
        current = False
        for line in lines:
            if _MAPPING.match(line):
                # one replaced since (the recorder saves by rename) is held until the next search opens the new one
                current = line.rstrip().removesuffix(" (deleted)").endswith(suffix)
            elif current and (field := line.partition(" ")[0]) in found:
                found[field] += int(line.split()[1]) * 1024
    return {"mapped_bytes": found["Size:"], "resident_bytes": found["Rss:"]}


def descendants(pid: int) -> list[int]:
    """The process's children, theirs, and so on (Linux's /proc; none elsewhere)."""
    children: list[int] = []
    for tasks in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(c) for c in tasks.read_text().split()]
        except OSError:  # gone meanwhile
            continue
    return [d for c in children for d in (c, *descendants(c))]


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")  # a mapping's first line in smaps; its fields follow
