"""`streamvqa replay VIDEO`: stream a file through the engine chunk by chunk and ask questions.

Answers are JSON lines on stdout. With --compare-offline each answer is checked against
ordinary one-shot transformers inference over the frames the version it was asked on still
holds (the project's first oracle, runnable on any file). Without eviction, and after evictions
with `--eviction exact`, the two must agree (the exit status says whether they did); after a
`rebase` or `absolute` eviction they are only reported: those caches are not a fresh encode.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from common import boot
from common.engine.answer import Answer, ask
from common.engine.eviction import MODES, EvictionPolicy
from common.engine.grid import Grid, StreamSpec, choose_grid, resize_to_grid
from common.engine.kvcache import Version
from common.engine.names import DEFAULT_MODEL
from common.engine.offline import offline_answer
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from common.engine.stream_engine import StreamEngine
from common.logs import configure_logging
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
    eviction: str
    salient_chunks: int


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamvqa replay", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv[1:]))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("video", help="a video file (anything FFmpeg reads)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub id, local path, tiny-random or random-3b")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--fps", type=float, default=2.0, help="frames per second sampled by presentation time")
    p.add_argument("--ask", action="append", default=[], dest="questions", help="a question (repeatable)")
    p.add_argument("--ask-every", type=float, default=None, help="also ask every N seconds of video")
    p.add_argument("--compare-offline", action="store_true", help="check each answer against one-shot inference")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens an answer has at most (default 64)")
    p.add_argument("--chunk-frames", type=int, default=4, help="frames per chunk, even (default 4)")
    p.add_argument("--min-pixels", type=int, default=128 * 28 * 28, help="model grid bounds per frame")
    p.add_argument("--max-pixels", type=int, default=256 * 28 * 28, help="(28x28 pixels per token)")
    p.add_argument("--max-cache-tokens", type=int, default=None, help="evict above this many cached tokens")
    p.add_argument("--eviction", choices=MODES, default="rebase", help="what retained chunks become (README)")
    p.add_argument("--salient-chunks", type=int, default=0, help="chunks kept for a scene change")


def run(ns: argparse.Namespace) -> int:
    if not ns.questions:
        ns.questions = ["Describe what happens in the video."]
    args = ReplayArgs(**{k: v for k, v in vars(ns).items() if k in ReplayArgs.__dataclass_fields__})
    if args.fps <= 0:
        raise SystemExit(f"--fps must be positive, got {args.fps}")
    configure_logging("WARNING")  # answers are the JSON lines on stdout; the engine only warns, on stderr
    rt = boot.load_model_or_exit(ns.model, ns.device)  # no weights to be had: exit 4, one line
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
            policy = EvictionPolicy(
                self.args.max_cache_tokens, mode=self.args.eviction, salient_chunks=self.args.salient_chunks
            )
            self.engine = StreamEngine(self.rt, spec, policy)
        grid = self.engine.spec.grid
        rgb = [resize_to_grid(f.rgb, grid) for f in chunk]
        self.frames.extend(rgb)
        version = self.engine.append(rgb, [f.pts for f in chunk], [f.index for f in chunk])
        if self.next_ask is not None and chunk[-1].pts >= self.next_ask:
            self.next_ask += self.args.ask_every
            yield from self._ask_all(version, "periodic")

    def _ask_all(self, version: Version, trigger: str) -> Iterator[bool | None]:
        for question in self.args.questions:
            params = GenerationParams(max_tokens=self.args.max_tokens)
            answer = ask(self.rt, version, question, params, keep_logits=self.args.compare_offline)
            line = {
                "type": "answer",
                "trigger": trigger,
                "question": question,
                "text": answer.text,
                "version": answer.version,
                "video_time": answer.capture_range,
                "video_ranges": version.capture_ranges,
                "cache_tokens": answer.cache_tokens,
                "evictions": version.stats.evictions,
                "tokens": len(answer.token_ids),
                "first_token_s": round(answer.first_token_s, 4),
                "total_s": round(answer.total_s, 4),
                "tokens_per_s": round(answer.tokens_per_s, 1),
            }
            match = None
            if self.args.compare_offline:
                match = self._compare(version, question, answer, line)
            print(json.dumps(line), flush=True)
            yield match

    def _compare(self, version: Version, question: str, answer: Answer, line: dict) -> bool | None:
        """One-shot inference over the frames `version` holds; returns whether it matched, or None
        where the policy does not promise a match (it is still reported)."""
        frames = [f for p in version.chunks for f in self.frames[p.segment.frame_seqs[0] : p.segment.frame_seqs[1] + 1]]
        grid: Grid = self.engine.spec.grid  # type: ignore[union-attr]
        offline = offline_answer(self.rt, frames, grid, self.args.fps, question, self.args.max_tokens)
        line["offline_match"] = offline.token_ids == answer.token_ids
        line["offline_text"] = offline.text
        line["offline_max_logit_diff"] = float((answer.first_logits.cpu() - offline.first_logits).abs().max())
        if version.stats.evictions and self.args.eviction != "exact":
            line["offline_note"] = (
                f"{self.args.eviction} eviction: retained chunks keep keys and values computed while evicted "
                "chunks were in the cache, so this is not a fresh encode of the frames it holds"
            )
            return None
        return line["offline_match"]
