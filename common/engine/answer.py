"""Answering from a snapshot: the question's tokens go to scratch space, the snapshot is only read.

A question costs its own tokens, whatever the length of the video behind it. The decode loop
is ours (explicit positions, our cache), so it behaves the same on every transformers 5.x.

A question is a `Generation`, step work: each step feeds it its pending tokens (the question
first, then the token just sampled) and samples the next one. `Generation.step_batch` advances
any number of questions — on any streams and versions — in one forward, which is how the
scheduler batches decoding; alone, the same code answers one question.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.engine.kvcache import Version
from common.engine.lm import Item
from common.engine.params import MAX_QUESTION_TOKENS, GenerationParams, QuestionError
from common.engine.phases import phase
from common.engine.positions import text_positions
from common.engine.runtime import Runtime
from common.engine.step_graphs import StepGraphs
from common.engine.work import StepWork, fail_all, start

if TYPE_CHECKING:
    from common.engine.pool import Region

CUDA_GRAPHS = True  # replay question steps from CUDA graphs on GPUs (off: the same steps, launched eagerly)


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    version: int
    cache_tokens: int
    capture_range: tuple[float, float] | None
    first_token_s: float
    total_s: float
    stop: str  # "eos" or "length"
    first_logits: torch.Tensor | None = None  # what the first token was drawn from, when asked for
    queued_s: float = 0.0  # from submission to its start on the GPU, on the clock total_s counts on
    # the version answered from: the one asked about, or the head when a live question started
    used: Version | None = field(default=None, repr=False, compare=False)

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.total_s - self.first_token_s
        return (len(self.token_ids) - 1) / decode_s if len(self.token_ids) > 1 and decode_s > 0 else 0.0


@dataclass
class Choice:
    best: int
    choice: str
    scores: list[float]  # mean log-probability per token of each option
    version: int


def question_suffix_ids(rt: Runtime, question: str) -> list[int]:
    """``<|vision_end|>{question}<|im_end|>\\n<|im_start|>assistant\\n``, the question encoded as text
    (special tokens split apart) between the template's own control tokens."""
    head, tail = rt.encode("<|vision_end|>"), rt.encode("<|im_end|>\n<|im_start|>assistant\n")
    return head + rt.encode(question, user=True) + tail


def _question_ids(rt: Runtime, question: str) -> list[int]:
    if not question or not question.strip():
        raise QuestionError("empty question")
    ids = question_suffix_ids(rt, question)
    if len(ids) > MAX_QUESTION_TOKENS:
        raise QuestionError(f"question is {len(ids)} tokens; the limit is {MAX_QUESTION_TOKENS}")
    return ids


def _sample(logits: torch.Tensor, params: GenerationParams, gen: torch.Generator | None) -> int:
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


@dataclass
class Decoded:
    token_ids: list[int]
    first_token_s: float
    total_s: float
    stop: str
    first_logits: torch.Tensor | None
    queued_s: float


# What a live question is answered from: the stream's head when the question starts on the GPU
# (None, or a head it cannot be answered from, raises: the question fails alone)
HeadSource = Callable[[], Version]


class Generation(StepWork):
    """One question being answered against one version: its scratch region (the version is only
    read), the tokens so far, and what the next step feeds. Its scratch is taken and its clock
    starts when it leaves the queue (`start`): `first_token_s` and `total_s` count from there.

    `version` is a `Version`, or a `HeadSource` for a live question: then the version is the head
    when the question starts on the GPU (`may_start_beside` or `start`, whichever binds it first),
    not when it was asked. A question waiting in the queue holds no version: a held version's
    pages make its stream's next eviction copy the whole cache (kvcache.py), and a long queue of
    questions, each holding an old cache, ran the pool out of room for the cameras' chunks."""

    def __init__(
        self,
        rt: Runtime,
        version: Version | HeadSource,
        question: str,
        params: GenerationParams,
        on_tokens: Callable[[list[int]], None] | None = None,
        keep_logits: bool = False,
        on_start: Callable[[], None] | None = None,
    ):
        super().__init__()
        ids = _question_ids(rt, question)  # a bad question fails here, before it is queued
        self.rt, self.params = rt, params
        self._head: HeadSource | None = None if isinstance(version, Version) else version
        self.version: Version | None = version if isinstance(version, Version) else None
        self.on_tokens, self.keep_logits, self.on_start = on_tokens, keep_logits, on_start
        self.scratch: Region | None = None
        self.started = False
        self.pending, self.length = ids, 0
        self.pos = self.version.text_start if self.version is not None else 0  # set when it is bound
        self.tokens: list[int] = []
        self.gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.stops = {rt.ids.im_end, rt.ids.endoftext}
        self.t0, self.first_token_s = time.perf_counter(), 0.0
        self.queued_s = 0.0
        self.first_logits: torch.Tensor | None = None

    def bound(self) -> Version:
        """The version it is answered from; a live question's head is looked up (once) now."""
        if self.version is None:
            assert self._head is not None
            self._bind(self._head())
        assert self.version is not None
        return self.version

    def _bind(self, version: Version) -> None:
        self.version, self._head, self.pos = version, None, version.text_start

    def start(self) -> None:
        """Its version (a live question's: the head now) and its scratch now, not while it waits:
        a long queue would hold pool pages for nothing."""
        if self.started:
            return
        self.bound()
        self.scratch = self.rt.lm.pool.alloc(self.scratch_tokens())
        self.started, self.queued_s, self.t0 = True, time.perf_counter() - self.t0, time.perf_counter()
        if self.on_start is not None:
            self.on_start()

    def item(self) -> Item:
        return Item(len(self.pending), self.scratch, self.length, base=self.bound().view)

    def item_ahead(self) -> Item:
        """Its item a step on: the one token the step in flight picks, written after that step's."""
        return Item(1, self.scratch, self.length + len(self.pending), base=self.bound().view)

    def goes_on_greedily(self) -> bool | None:
        """Whether its next token, once the step in flight picks it, is that step's greedy pick
        and is fed to another step: True; False when that token is its last by length (it needs
        no step after); None when the host must see the step's logits first (it samples, or
        keeps its first logits)."""
        if self.params.temperature != 0.0 or (self.keep_logits and not self.tokens):
            return None
        return len(self.tokens) + 1 < self.params.max_tokens

    def scratch_tokens(self) -> int:
        """Its scratch, in whole pages: the question, every token it may answer, and the room its
        prefill's graph writes (asked before it starts: `pending` is the question then)."""
        ids, pool = self.pending, self.rt.lm.pool
        return (
            pool.pages_for(max(len(ids) + self.params.max_tokens, StepGraphs.prefill_room(len(ids)))) * pool.page_tokens
        )

    def pins(self) -> tuple[object, int] | None:
        """Its version's stream, and a copy of that stream's cache (its run, in whole pages): while
        it reads the version, the stream's next eviction may have to copy the cache around it. A
        live question not started yet would read the head it finds now."""
        version = self.version
        if version is None:
            assert self._head is not None
            try:
                version = self._head()
            except Exception:  # it fails when it starts: nothing to keep room for
                return None
        pool = self.rt.lm.pool
        return version.stream, pool.pages_for(max(version.run_tokens, version.tokens)) * pool.page_tokens

    def may_start_beside(self) -> bool:
        """Its scratch is its own (the pool hands out no page an encode step may still be
        reading); its version may be one the encode step in flight is still writing. A live
        question is bound to the head only when that head is written (then it starts at once);
        otherwise it stays unbound, and may start later from a newer head."""
        if self.version is not None:
            return self.version.is_written()
        assert self._head is not None
        try:
            head = self._head()
        except Exception:  # its own failure: `start` (outside this check) raises it again and fails it
            return True
        if not head.is_written():
            return False
        self._bind(head)
        return True

    @classmethod
    def launch_batch(cls, batch: Sequence[StepWork], alongside: bool = False) -> _Step:
        gens = [j for j in batch if isinstance(j, Generation)]
        return _Step([g for g in gens if g.started or start(g)], alongside)  # started here when stepped by hand

    def _advance(self, logits: torch.Tensor, greedy: int) -> None:
        self.length += len(self.pending)
        self.pos += len(self.pending)
        if not self.tokens and self.keep_logits:
            self.first_logits = logits.clone()
        token = greedy if self.params.temperature == 0.0 else _sample(logits, self.params, self.gen)
        if not self.tokens:
            self.first_token_s = time.perf_counter() - self.t0
        if token in self.stops:
            return self._finish("eos")
        self.tokens.append(token)
        if self.on_tokens is not None:
            self.on_tokens(list(self.tokens))
        if len(self.tokens) == self.params.max_tokens:
            return self._finish("length")  # no forward for a token nobody will read
        self.pending = [token]

    def _finish(self, stop: str) -> None:
        total = time.perf_counter() - self.t0
        self.scratch = None  # back to the pool now, not when the caller drops this work
        self.future.set_result(
            Decoded(self.tokens, self.first_token_s or total, total, stop, self.first_logits, self.queued_s)
        )


class _Step:
    """One decode step of `gens`, queued on the device: on a GPU on its own high-priority CUDA stream, so
    that beside an encode step (see interleave.py) its kernels go first as the encode step's
    finish. Its greedy picks come back to pinned host memory; `complete` reads them.

    Given `picks` (the greedy picks of the step before, still on the device: `ahead`), each
    generation is fed its pick, one step on from what the host has read: the step is queued
    before the host reads the one before, so the device never waits for the host between them
    (a lone question's step was 4.9 ms of wall time for 2.7 ms on an H200)."""

    def __init__(self, gens: list[Generation], alongside: bool, picks: torch.Tensor | None = None):
        self.gens = gens
        self.error: Exception | None = None
        self.cuda_stream = _decode_cuda_stream(gens[0].rt.device) if gens else None
        self.started: torch.cuda.Event | None = None
        self.done: torch.cuda.Event | None = None
        # Its scratch regions, held until it is dropped: a generation that stops in the step
        # before lets go of its scratch while this step may still write a token into it.
        self.scratch = [g.scratch for g in gens]
        if not gens:
            return
        try:
            with phase("decode launch"), _outside_inference(), _on(self.cuda_stream):
                if self.cuda_stream is not None and not alongside:  # what the caller queued comes first
                    self.cuda_stream.wait_stream(torch.cuda.default_stream(self.cuda_stream.device))
                if self.cuda_stream is not None:
                    self.started = torch.cuda.Event(enable_timing=True)
                    self.started.record(self.cuda_stream)
                self.logits, self.picks = _forward(gens, picks)
                self.greedy = self.picks.to("cpu", non_blocking=True)
                if self.cuda_stream is not None:
                    self.done = torch.cuda.Event(enable_timing=True)
                    self.done.record(self.cuda_stream)
        except Exception as e:
            self.error = e

    @property
    def work(self) -> list[Generation]:
        return self.gens

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def ahead(self) -> _Step | None:
        """The next step of the generations that go on, queued now, before this one is read,
        their tokens this step's greedy picks; None when one of them samples or keeps its first
        logits (the host must read this step first), or none goes on. One that stops at this
        step's token (end of text) has a token made for nothing, which `complete` leaves out."""
        if self.error is not None or not self.gens:
            return None
        goes_on = [False if g.done else g.goes_on_greedily() for g in self.gens]  # done: stopped a step before
        if None in goes_on or not any(goes_on):
            return None
        rows = [i for i, going in enumerate(goes_on) if going]
        with _outside_inference(), _on(self.cuda_stream):  # the picks' copy on the steps' CUDA stream
            if len(rows) == len(self.gens):
                picks = self.picks.clone()  # a graph's output: the next replay overwrites it
            else:
                picks = self.picks.index_select(0, torch.tensor(rows).to(self.picks.device, non_blocking=True))
        return _Step([self.gens[i] for i in rows], alongside=False, picks=picks)

    def device_s(self) -> float | None:
        if self.started is None or self.done is None or self.error is not None:
            return None
        return self.started.elapsed_time(self.done) / 1000

    def complete(self) -> None:
        if self.error is not None:
            return fail_all(self.gens, self.error)
        if not self.gens:
            return
        try:
            with phase("decode complete"), _outside_inference(), _on(self.cuda_stream):
                if self.done is not None:
                    with phase("decode wait"):
                        self.done.synchronize()
                greedy = self.greedy.tolist()
                for i, g in enumerate(self.gens):
                    if g.done:  # it stopped at the step before this one, queued ahead of reading it
                        continue
                    try:
                        g._advance(self.logits[i], greedy[i])
                    except Exception as e:  # its own sampling or token callback: the others' tokens stand
                        fail_all([g], e)
            if self.cuda_stream is not None:  # a kept copy of the logits is read on the default CUDA stream
                torch.cuda.default_stream(self.cuda_stream.device).wait_stream(self.cuda_stream)
        except Exception as e:
            fail_all(self.gens, e)


_DECODE_CUDA_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _decode_cuda_stream(device: torch.device) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    if device not in _DECODE_CUDA_STREAMS:
        _DECODE_CUDA_STREAMS[device] = torch.cuda.Stream(device, priority=-1)  # lower is sooner
    return _DECODE_CUDA_STREAMS[device]


def _outside_inference() -> torch.inference_mode:
    """Beside an encode step a step runs inside that forward's inference mode; a graph captured
    there would get inference tensors as its input buffers, which no later replay could write."""
    return torch.inference_mode(False)


def _on(cuda_stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if cuda_stream is None else torch.cuda.stream(cuda_stream)


def _forward(gens: Sequence[Generation], picks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every generation's pending tokens through the model (given `picks`, a step on: each one's
    pick, see `_Step`): logits (B, V) at each one's last token and their greedy picks (B,), on the
    device. On a GPU with graphs, questions being prefilled (joining a batch mid-decode, or
    arriving together) run apart from the decoding ones, from graphs of their own
    (`_prefill_groups`): a mixed batch has no graph, and run eagerly it costs several times the
    graphed steps together (an answer does not depend on its batch, so the split changes nothing
    in it)."""
    rt = gens[0].rt
    if not (rt.lm.flash and CUDA_GRAPHS):
        return _forward_batch(gens, picks=picks)
    if rt.step_graphs is None:
        rt.step_graphs = StepGraphs(rt.lm, on_capture=rt.on_graph_capture)
    if picks is not None:  # every one decodes
        return _forward_batch(gens, rt.step_graphs, picks)
    decoding = [g for g in gens if len(g.pending) == 1]
    groups = [decoding] if decoding else []
    groups += _prefill_groups([g for g in gens if len(g.pending) > 1])
    if len(groups) == 1:
        return _forward_batch(gens, rt.step_graphs)
    # cloned: graphs share one memory pool, so the next replay may overwrite this one's outputs
    outs = [tuple(t.clone() for t in _forward_batch(group, rt.step_graphs)) for group in groups]
    row = {id(g): i for i, g in enumerate(g for group in groups for g in group)}
    where = torch.tensor([row[id(g)] for g in gens]).to(outs[0][0].device, non_blocking=True)
    return torch.cat([o[0] for o in outs])[where], torch.cat([o[1] for o in outs])[where]


def _prefill_groups(gens: Sequence[Generation]) -> list[list[Generation]]:
    """Questions being prefilled, in batches that one prefill graph takes: of one length bucket,
    as many as its rows allow, in the order they came."""
    by_length: dict[int, list[Generation]] = {}
    for g in gens:
        by_length.setdefault(StepGraphs.prefill_room(len(g.pending)), []).append(g)
    groups = []
    for length, same in by_length.items():
        size = StepGraphs.prefill_batch(length)
        groups += [same[i : i + size] for i in range(0, len(same), size)]
    return groups


def _forward_batch(
    gens: Sequence[Generation], graphs: StepGraphs | None = None, picks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of `gens` (given `picks`, a step on), replayed from a graph when one fits its shape."""
    lm = gens[0].rt.lm
    if picks is None:
        ids = [t for g in gens for t in g.pending]
        positions = [p for g in gens for p in range(g.pos, g.pos + len(g.pending))]  # text: all three axes alike
        items = [g.item() for g in gens]
    else:
        ids = [0] * len(gens)  # where the picks go, on the device
        positions = [g.pos + len(g.pending) for g in gens]
        items = [g.item_ahead() for g in gens]
    base_tokens = max(g.bound().tokens for g in gens)
    if graphs is not None:
        graphed = graphs.run(ids, positions, items, base_tokens, picks)
        if graphed is not None:
            return graphed
    split = lm.split_for(len(gens), max(it.n for it in items), base_tokens)
    hidden = lm.forward(
        lm.embed(ids if picks is None else picks), torch.tensor(positions).expand(3, -1), lm.plan(items, split)
    )
    last = torch.tensor([it.n for it in items]).cumsum(0) - 1
    logits = lm.logits(hidden[last.to(hidden.device, non_blocking=True)])
    return logits, logits.argmax(dim=-1)


@dataclass(frozen=True)
class Waiting:
    """How `ask` tells its caller, in the caller's thread, that the question waits for the GPU:
    `on_start` once it starts; `on_queued` after `first_s` of waiting, then every `every_s`."""

    on_queued: Callable[[], None] | None = None
    on_start: Callable[[], None] | None = None
    first_s: float = 0.2
    every_s: float = 1.0


_STARTED, _DONE = object(), object()  # besides token lists, what a question's thread is told


def ask(
    rt: Runtime,
    version: Version | HeadSource,
    question: str,
    params: GenerationParams | None = None,
    on_delta: Callable[[str], None] | None = None,
    keep_logits: bool = False,
    waiting: Waiting | None = None,
) -> Answer:
    """Answer `question` against `version` (or, given a `HeadSource`, against the stream's head
    when the question starts on the GPU: `Answer.used` says which), calling `on_delta(text)` as
    text becomes printable (in this thread: detokenizing and delivering never hold up the GPU),
    and `waiting`'s calls while it waits for the GPU."""
    params, waiting = params or GenerationParams(), waiting or Waiting()
    updates: queue.SimpleQueue[object] = queue.SimpleQueue()
    tokens = updates.put if on_delta else None
    work = Generation(rt, version, question, params, tokens, keep_logits, lambda: updates.put(_STARTED))
    work.future.add_done_callback(lambda _: updates.put(_DONE))
    rt.executor.submit(work)
    emitted, report_in = "", waiting.first_s
    while (update := _next(updates, report_in if waiting.on_queued else None)) is not _DONE:
        if update is None:  # still waiting to start
            if waiting.on_queued is not None:
                waiting.on_queued()
            report_in = waiting.every_s
        elif update is _STARTED:
            report_in = None
            if waiting.on_start is not None:
                waiting.on_start()
        elif on_delta is not None:
            text = rt.tokenizer.decode(update, skip_special_tokens=True)
            if not text.endswith("\ufffd") and len(text) > len(emitted):  # never half a UTF-8 character
                on_delta(text[len(emitted) :])
                emitted = text
    done: Decoded = work.future.result()
    text = rt.tokenizer.decode(done.token_ids, skip_special_tokens=True)
    if on_delta and len(text) > len(emitted):
        on_delta(text[len(emitted) :])
    used = work.bound()
    return Answer(
        text=text,
        token_ids=done.token_ids,
        version=used.id,
        cache_tokens=used.tokens,
        capture_range=used.capture_range,
        first_token_s=done.first_token_s,
        total_s=done.total_s,
        stop=done.stop,
        first_logits=done.first_logits,
        queued_s=done.queued_s,
        used=used,
    )


def _next(updates: queue.SimpleQueue[object], timeout_s: float | None) -> object:
    """What the generation reported next, or None after `timeout_s` (None: no limit)."""
    try:
        return updates.get(timeout=timeout_s)
    except queue.Empty:
        return None


def choose(rt: Runtime, version: Version, question: str, choices: list[str]) -> Choice:
    """Multiple choice: each option scored by its mean token log-probability after the question."""
    if len(choices) < 2:
        raise QuestionError("multiple choice needs at least two options")
    ids = _question_ids(rt, question)
    options = [rt.encode(c, user=True) for c in choices]
    if any(not o for o in options):
        raise QuestionError("empty option")
    scores = rt.executor.call(lambda: _score_options(rt, version, ids, options))
    best = max(range(len(choices)), key=scores.__getitem__)
    return Choice(best=best, choice=choices[best], scores=scores, version=version.id)


def _score_options(rt: Runtime, version: Version, ids: list[int], options: list[list[int]]) -> list[float]:
    lm, pos = rt.lm, version.text_start
    scratch = lm.pool.alloc(len(ids) + max(len(o) for o in options))

    def feed(tokens: list[int], at: int) -> torch.Tensor:
        item = Item(len(tokens), scratch, at, base=version.view)
        return lm.forward(lm.embed(tokens), text_positions(pos + at, len(tokens)), lm.plan([item]))

    last = feed(ids, 0)[-1:]
    scores = []
    for option in options:  # each option overwrites the previous one's scratch tokens
        hidden = torch.cat([last, feed(option[:-1], len(ids))]) if len(option) > 1 else last
        logp = torch.log_softmax(lm.logits(hidden), dim=-1)
        target = torch.tensor(option, device=logp.device)
        scores.append(float(logp[torch.arange(len(option), device=logp.device), target].mean()))
    return scores
