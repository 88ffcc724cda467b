"""`streamvqa replay VIDEO`: stream a file through the engine chunk by chunk and ask questions.

Answers are JSON lines on stdout. With --compare-offline each answer is checked against
ordinary one-shot transformers inference over the frames of the version it was asked on
(the project's first oracle, runnable on any file).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from common.engine.answer import ask
from common.engine.eviction import EvictionPolicy
from common.engine.grid import Grid, StreamSpec, choose_grid, resize_to_grid
from common.engine.kvcache import Version
from common.engine.model import load_model
from common.engine.names import DEFAULT_MODEL
from common.engine.offline import offline_answer
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.stream import StreamEngine
from ingest.video import DecodedFrame, SourceError, iter_file_frames


@dataclass
class ReplayArgs:
    video: str
    fps: float
    questions: list[str]
    ask_every: float | None
    compare_offline: bool
    max_tokens: int
    chunk_frames: int
    min_pixels: int
    max_pixels: int
    max_cache_tokens: int | None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("video", help="a video file (anything FFmpeg reads)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub id, local path, tiny-random or random-3b")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--fps", type=float, default=2.0, help="frames per second sampled by presentation time")
    p.add_argument("--ask", action="append", default=[], dest="questions", help="a question (repeatable)")
    p.add_argument("--ask-every", type=float, default=None, help="also ask every N seconds of video")
    p.add_argument("--compare-offline", action="store_true", help="check each answer against one-shot inference")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunk-frames", type=int, default=4)
    p.add_argument("--min-pixels", type=int, default=128 * 28 * 28)
    p.add_argument("--max-pixels", type=int, default=256 * 28 * 28)
    p.add_argument("--max-cache-tokens", type=int, default=None, help="evict above this many cached tokens")


def run(ns: argparse.Namespace) -> int:
    if not ns.questions:
        ns.questions = ["Describe what happens in the video."]
    args = ReplayArgs(**{k: v for k, v in vars(ns).items() if k in ReplayArgs.__dataclass_fields__})
    if args.fps <= 0:
        raise SystemExit(f"--fps must be positive, got {args.fps}")
    rt = Runtime(load_model(ns.model, device=ns.device))
    try:
        matches = [m for m in Replay(rt, args).run() if m is not None]
    except SourceError as e:
        print(f"streamvqa replay: {e}", file=sys.stderr)
        return 2
    return 0 if all(matches) else 1


class Replay:
    def __init__(self, rt: Runtime, args: ReplayArgs):
        self.rt, self.args = rt, args
        self.frames: list[np.ndarray] = []  # every sampled frame, for the offline comparison
        self.engine: StreamEngine | None = None
        self.next_ask = args.ask_every

    def run(self) -> Iterator[bool | None]:
        """Streams the file, printing answers; yields offline_match of each answer (None: not compared)."""
        bar = tqdm(desc="replay", unit="frame", file=sys.stderr, disable=None)
        chunk: list[DecodedFrame] = []
        for frame in iter_file_frames(self.args.video, self.args.fps):
            bar.update(1)
            chunk.append(frame)
            if len(chunk) == self.args.chunk_frames:
                yield from self._append(chunk)
                chunk = []
        if chunk:
            yield from self._append(chunk)
        bar.close()
        if self.engine is None:
            raise SystemExit(f"{self.args.video}: no frames decoded")
        yield from self._ask_all(self.engine.head, "end")

    def _append(self, chunk: list[DecodedFrame]) -> Iterator[bool | None]:
        if self.engine is None:
            h, w = chunk[0].rgb.shape[:2]
            grid = choose_grid(h, w, min_pixels=self.args.min_pixels, max_pixels=self.args.max_pixels)
            spec = StreamSpec("replay", self.args.fps, grid, self.args.chunk_frames)
            self.engine = StreamEngine(self.rt, spec, EvictionPolicy(max_cache_tokens=self.args.max_cache_tokens))
        grid = self.engine.spec.grid
        rgb = [resize_to_grid(f.rgb, grid) for f in chunk]
        self.frames.extend(rgb)
        version = self.engine.append(rgb, [f.pts for f in chunk], [f.index for f in chunk])
        if self.next_ask is not None and chunk[-1].pts >= self.next_ask:
            self.next_ask += self.args.ask_every
            yield from self._ask_all(version, "periodic")

    def _ask_all(self, version: Version, trigger: str) -> Iterator[bool | None]:
        for question in self.args.questions:
            answer = ask(self.rt, version, question, GenerationParams(max_tokens=self.args.max_tokens))
            line = {
                "type": "answer",
                "trigger": trigger,
                "question": question,
                "text": answer.text,
                "version": answer.version,
                "video_time": answer.capture_range,
                "cache_tokens": answer.cache_tokens,
                "tokens": len(answer.token_ids),
                "first_token_s": round(answer.first_token_s, 4),
                "total_s": round(answer.total_s, 4),
                "tokens_per_s": round(answer.tokens_per_s, 1),
            }
            match = None
            if self.args.compare_offline:
                match = self._compare(version, question, answer.token_ids, line)
            print(json.dumps(line), flush=True)
            yield match

    def _compare(self, version: Version, question: str, token_ids: list[int], line: dict) -> bool | None:
        if version.stats.chunks_evicted:
            line["offline_match"] = None
            line["offline_note"] = "chunks were evicted: the streamed cache is not a one-shot encode any more"
            return None
        frames = self.frames[: version.last_frame_seq + 1]
        grid: Grid = self.engine.spec.grid  # type: ignore[union-attr]
        offline = offline_answer(self.rt, frames, grid, self.args.fps, question, self.args.max_tokens)
        line["offline_match"] = offline.token_ids == token_ids
        line["offline_text"] = offline.text
        return line["offline_match"]
