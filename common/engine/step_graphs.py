"""Question steps replayed from CUDA graphs (`StepGraphs`): a decode step of a few questions is
~800 small kernels, which launched one by one from Python bound a question's speed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import structlog
import torch

from common.engine.lm import Item, KVView, LanguageModel, Plan
from common.engine.params import MAX_NEW_TOKENS, MAX_QUESTION_TOKENS

log = structlog.get_logger()

GRAPH_BASE_TOKENS = 32768  # question graphs are sized for caches up to this (longer ones: more graphs)


class StepGraphs:
    """Question steps replayed from CUDA graphs: eagerly a step is thousands of small kernel
    launches from Python, which is what bounds a question's speed. Two shapes are graphed, each
    per batch-size bucket and split, the batch padded to its bucket with items that read and
    write a dummy region:

    - decode steps (one token per item);
    - prefills (items of several tokens, of one length bucket), per length bucket: each item's
      tokens are padded at the end (causal: a padding token is seen by no real one) into its own
      region. Questions arriving together are prefilled in one replay, not one after another
      (32 at once, each alone from its own graph, made the last wait 32 prefills).

    Anything else (decode and prefill items in one batch, a prefill longer than the last bucket)
    runs eagerly. The plan's indices, tokens, positions and each item's last row are copied into
    the graph's own buffers before each replay; logits are made at the last rows only.

    A graph is fixed to a bound on its key ranges (flash's max_k); bounds sized for caches up to
    `base_tokens` and for the longest question and answer keep one graph per batch shape while
    caches grow, where bounds that followed the caches (as an eager step's do) would capture a new
    graph, a stall of the GPU loop, each time a cache crossed a power of two."""

    BUCKETS = (1, 2, 4, 8, 16, 32, 64)
    PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)
    PREFILL_ROWS = 1024  # a prefill graph's most tokens (items x length bucket): its activations' bound
    OWN_TOKENS = MAX_QUESTION_TOKENS + MAX_NEW_TOKENS  # the longest scratch a question reads

    @classmethod
    def prefill_room(cls, n: int) -> int:
        """Scratch tokens a prefill of `n` tokens needs for it to be graphed (its padded length)."""
        return next((b for b in cls.PREFILL_BUCKETS if b >= n), n)

    @classmethod
    def prefill_batch(cls, n: int) -> int:
        """How many prefills of `n` tokens one graph takes."""
        return max(1, cls.PREFILL_ROWS // cls.prefill_room(n))

    def __init__(
        self,
        lm: LanguageModel,
        base_tokens: int = GRAPH_BASE_TOKENS,
        on_capture: Callable[[float], None] | None = None,
    ):
        """`on_capture(seconds)` after each capture (metrics hook in here)."""
        self.lm = lm
        self.base_tokens = base_tokens
        self.on_capture = on_capture
        self.dummy = lm.pool.alloc(self.PREFILL_BUCKETS[-1])  # what padding items write, and read
        self.dummy_base = KVView((lm.pool.hold(self.dummy.slab, self.dummy.start, 1),))
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: set[tuple] = set()  # shapes whose capture failed: eager from then on
        self.mempool = None  # the graphs' shared memory pool, made with the first

    def run(
        self,
        tokens: list[int],
        positions: list[int],
        items: list[Item],
        base_tokens: int,
        picks: torch.Tensor | None = None,
    ):
        """(logits (B, V), greedy ids (B,)) at each item's last token, on the device; or None when
        this batch's shape is not graphed. `base_tokens`: the longest base an item reads. `picks`:
        a decode step's tokens on the device, in place of `tokens`."""
        shape = self.padded(tokens, positions, items)
        if shape is None:
            return None
        tokens, positions, padded, last = shape
        # split-KV from the padded shape, the graph's, not the batch's: batches of 5 to 8 questions
        # (or prefills of 33 to 64 tokens) share one graph instead of each capturing its own
        split = self.lm.split_for(len(padded), padded[0].n, base_tokens)
        plan = self.lm.plan(padded, split, device=False, max_k_floor=(self.OWN_TOKENS, -(-self.base_tokens // split)))
        if plan.single_slab is None:  # spread over slabs: rare, and its shapes vary
            return None
        key = (tuple(it.n for it in padded), split, plan.single_slab, plan.shape)
        graph = self.graphs.get(key)
        if graph is None and key not in self.failed:
            graph = self._capture(key, plan, len(tokens))
        if graph is None:
            return None
        logits, greedy = graph.replay(tokens, positions, last, plan, picks)
        return logits[: len(items)], greedy[: len(items)]

    def _capture(self, key: tuple, plan: Plan, rows: int) -> _Graph | None:
        """The graph of `key`, or None when its capture failed: that shape then runs eagerly for
        good. A capture that cuBLAS refused mid-serving (an H200 with 64 cameras and 32 askers,
        2026-11-28: `CUBLAS_STATUS_EXECUTION_FAILED`, then `operation not permitted when stream is
        capturing`) ended the worker; the capture is only a faster way to run the same step, so it
        costs that shape its speed, not the process. An error the device cannot recover from
        fails the next eager step, and the GPU loop ends as for any failed device."""
        t0 = time.perf_counter()
        if self.mempool is None:
            self.mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.current_stream()
        try:
            graph = self.graphs[key] = _Graph(self.lm, plan, rows, len(key[0]), self.mempool)
        except RuntimeError as error:  # torch.AcceleratorError is one
            _after_failed_capture(stream)
            self.failed.add(key)
            log.warning("question step graph capture failed, shape runs eagerly", shape=repr(key), error=str(error))
            return None
        seconds = time.perf_counter() - t0
        if self.on_capture is not None:
            self.on_capture(seconds)
        # the GPU loop stands still meanwhile: how often and how long is worth seeing
        log.info("question step graph captured", shape=repr(key), graphs=len(self.graphs), seconds=round(seconds, 2))
        return graph

    def padded(self, tokens: list[int], positions: list[int], items: list[Item]):
        """The batch as a graph runs it: (tokens, positions, items, each real item's last row), all
        items of one length (1, or a prefill bucket) and as many as a bucket; None when no graph
        takes it."""
        decode = all(it.n == 1 for it in items)
        length = 1 if decode else next((b for b in self.PREFILL_BUCKETS if b >= max(it.n for it in items)), None)
        batch = next((b for b in self.BUCKETS if b >= len(items)), None)
        if length is None or batch is None or (not decode and batch * length > self.PREFILL_ROWS):
            return None
        if not decode and any(it.n == 1 or it.at + length > it.dest.size for it in items):
            return None
        padded_tokens, padded_positions, last = [], [], []
        row = 0
        for it in items:
            pad, own = length - it.n, positions[row : row + it.n]
            padded_tokens += tokens[row : row + it.n] + [0] * pad
            padded_positions += own + list(range(own[-1] + 1, own[-1] + 1 + pad))
            last.append(len(padded_tokens) - pad - 1)
            row += it.n
        dummies = batch - len(items)
        padded_tokens += [0] * (dummies * length)
        padded_positions += positions[-1:] * (dummies * length)
        last += [len(padded_tokens) - 1] * dummies
        dummy = Item(length, self.dummy, 0, base=self.dummy_base)
        return padded_tokens, padded_positions, [replace(it, n=length) for it in items] + [dummy] * dummies, last


def _after_failed_capture(stream: torch.cuda.Stream) -> None:
    """What a capture that failed to end leaves behind in torch: its own CUDA stream current, and
    the device's random generator still marked as capturing (every later random op on the device
    then fails: "Offset increment outside graph capture"). The generator gets a copy of its
    state, seed and offset kept, outside any capture."""
    torch.cuda.set_stream(stream)
    generator = torch.cuda.default_generators[stream.device.index]
    generator.graphsafe_set_state(generator.clone_state())


class _Graph:
    def __init__(self, lm: LanguageModel, host_plan: Plan, rows: int, items: int, mempool):
        self.lm = lm
        dev = lm.device
        self.plan = host_plan.to(dev)  # its buffers are the graph's index buffers
        self.io = torch.zeros(4, rows, dtype=torch.long, device=dev)  # tokens, then (t, h, w) positions
        self.last = torch.zeros(items, dtype=torch.long, device=dev)  # each item's last row
        side_cuda_stream = torch.cuda.Stream()
        side_cuda_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_cuda_stream):
            self._step()  # warm-up outside the graph (allocations, kernel selection, compilation)
        torch.cuda.current_stream().wait_stream(side_cuda_stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool, capture_error_mode="thread_local"):
            self.out = self._step()

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.lm.forward(self.lm.embed(self.io[0]), self.io[1:], self.plan)
        logits = self.lm.logits(hidden.index_select(0, self.last))
        return logits, logits.argmax(dim=-1)

    def replay(
        self, tokens: list[int], positions: list[int], last: list[int], host_plan: Plan, picks: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.io.copy_(torch.tensor([tokens, positions, positions, positions]), non_blocking=True)
        if picks is not None:  # a decode step's: one row an item, the real items first
            self.io[0, : len(picks)].copy_(picks)
        self.last.copy_(torch.tensor(last), non_blocking=True)
        self.plan.longs.copy_(host_plan.longs, non_blocking=True)
        self.plan.ints.copy_(host_plan.ints, non_blocking=True)
        self.graph.replay()
        return self.out
