"""Answering from a snapshot: the question's tokens go to scratch space, the snapshot is only read.

A question costs its own tokens, whatever the length of the video behind it. The decode loop
is ours (explicit positions, our cache), so it behaves the same on every transformers 5.x.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from common.engine.kvcache import Version
from common.engine.params import MAX_QUESTION_TOKENS, GenerationParams, QuestionError
from common.engine.positions import text_positions
from common.engine.runtime import Runtime

CUDA_GRAPHS = True  # replay decode steps as CUDA graphs on GPUs (off: the same steps, launched eagerly)


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


def question_suffix(question: str) -> str:
    return f"<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"


class _Session:
    """Scratch K/V for one question on one version; the version's arena is never written."""

    def __init__(self, rt: Runtime, version: Version, capacity: int):
        self.rt, self.version = rt, version
        self.scratch = rt.lm.new_kv(capacity, zeroed=True)  # decode steps read all of it, masked
        self.length = 0

    def feed(self, ids: list[int], pos0: int) -> torch.Tensor:
        """Run tokens at text positions pos0.. ; returns final hidden states (L, D)."""
        lm = self.rt.lm
        hidden = lm.forward(
            lm.embed(ids), text_positions(pos0, len(ids)), self.scratch, self.length, base=self.version.view
        )
        self.length += len(ids)
        return hidden


class _Decoder:
    """One-token decode steps with fixed shapes (position and length live in device tensors). On
    CUDA the step is captured once per question as a graph and replayed for every token: eagerly
    a step is some two thousand small kernel launches from Python, which is what bounds decode."""

    def __init__(self, session: _Session):
        self.session = session
        dev = session.rt.lm.device
        self.token, self.pos, self.at = (torch.zeros(1, dtype=torch.long, device=dev) for _ in range(3))
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.use_graph = CUDA_GRAPHS and dev.type == "cuda"

    @torch.inference_mode()
    def __call__(self, token: int, pos: int) -> torch.Tensor:
        """Logits after feeding `token` at text position `pos` (valid until the next call)."""
        self.token.fill_(token)
        self.pos.fill_(pos)
        self.at.fill_(self.session.length)
        if self.use_graph and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        self.session.length += 1
        return self.logits

    def _step(self) -> None:
        lm = self.session.rt.lm
        hidden = lm.forward(
            lm.embed_tokens(self.token),
            self.pos.expand(3, 1),
            self.session.scratch,
            self.at,
            base=self.session.version.view,
        )
        self.logits = lm.lm_head(hidden[0]).float()

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step()  # warm-up outside the graph (allocations, kernel selection); same inputs
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self._step()


def _question_ids(rt: Runtime, question: str) -> list[int]:
    if not question or not question.strip():
        raise QuestionError("empty question")
    ids = rt.encode(question_suffix(question))
    if len(ids) > MAX_QUESTION_TOKENS:
        raise QuestionError(f"question is {len(ids)} tokens; the limit is {MAX_QUESTION_TOKENS}")
    return ids


def _sample(logits: torch.Tensor, params: GenerationParams, gen: torch.Generator | None) -> int:
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def iter_tokens(rt: Runtime, version: Version, question: str, params: GenerationParams) -> Iterator[int]:
    """Token ids of the answer as they are decoded (stops before <|im_end|>)."""
    ids = _question_ids(rt, question)
    session = _Session(rt, version, len(ids) + params.max_tokens)
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    pos = version.text_start
    with rt.gpu_lock:
        hidden = session.feed(ids, pos)
    pos += len(ids)
    stops = {rt.ids.im_end, rt.ids.endoftext}
    logits, decoder = rt.lm.logits(hidden[-1]), _Decoder(session)
    for step in range(params.max_tokens):
        token = _sample(logits, params, gen)
        if token in stops:
            return
        yield token
        if step == params.max_tokens - 1:
            return  # no forward for a token nobody will read
        with rt.gpu_lock:
            logits = decoder(token, pos)
        pos += 1


def ask(
    rt: Runtime,
    version: Version,
    question: str,
    params: GenerationParams | None = None,
    on_delta: Callable[[str], None] | None = None,
) -> Answer:
    """Answer `question` against `version`, calling `on_delta(text)` as text becomes printable."""
    params = params or GenerationParams()
    t0 = time.perf_counter()
    first_token_s = 0.0
    tokens: list[int] = []
    emitted = ""
    for token in iter_tokens(rt, version, question, params):
        if not tokens:
            first_token_s = time.perf_counter() - t0
        tokens.append(token)
        if on_delta is None:
            continue
        text = rt.tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd") and len(text) > len(emitted):  # never half a UTF-8 character
            on_delta(text[len(emitted) :])
            emitted = text
    total = time.perf_counter() - t0
    text = rt.tokenizer.decode(tokens, skip_special_tokens=True)
    if on_delta and len(text) > len(emitted):
        on_delta(text[len(emitted) :])
    return Answer(
        text=text,
        token_ids=tokens,
        version=version.id,
        cache_tokens=version.tokens,
        capture_range=version.capture_range,
        first_token_s=first_token_s or total,
        total_s=total,
        stop="length" if len(tokens) == params.max_tokens else "eos",
    )


def first_token_logits(rt: Runtime, version: Version, question: str) -> torch.Tensor:
    """Logits at the last question position (what the first answer token is drawn from)."""
    ids = _question_ids(rt, question)
    session = _Session(rt, version, len(ids))
    with rt.gpu_lock:
        return rt.lm.logits(session.feed(ids, version.text_start)[-1])


def choose(rt: Runtime, version: Version, question: str, choices: list[str]) -> Choice:
    """Multiple choice: each option scored by its mean token log-probability after the question."""
    if len(choices) < 2:
        raise QuestionError("multiple choice needs at least two options")
    ids = _question_ids(rt, question)
    options = [rt.encode(c) for c in choices]
    if any(not o for o in options):
        raise QuestionError("empty option")
    session = _Session(rt, version, len(ids) + max(len(o) for o in options))
    pos = version.text_start
    with rt.gpu_lock:
        last = session.feed(ids, pos)[-1:]
        scores = []
        for option in options:
            session.length = len(ids)  # each option overwrites the previous one's scratch tokens
            hidden = torch.cat([last, session.feed(option[:-1], pos + len(ids))]) if len(option) > 1 else last
            logp = torch.log_softmax(rt.lm.logits(hidden), dim=-1)
            target = torch.tensor(option, device=logp.device)
            scores.append(float(logp[torch.arange(len(option), device=logp.device), target].mean()))
    best = max(range(len(choices)), key=scores.__getitem__)
    return Choice(best=best, choice=choices[best], scores=scores, version=version.id)
