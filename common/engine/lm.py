"""Our own forward pass of Qwen2.5-VL's language model, batched over streams and questions.

transformers' modules supply the weights and the per-layer maths (norms, projections, MLP);
this file owns the cache and the attention, because the cache is the product. Every cache lives
in pages of the device's KV pool (pool.py), as a few contiguous slot ranges (a `KVView`'s extents,
usually one). One forward runs any mix of work, each item a few new tokens written into a region:

- a chunk of video (or the prompt prefix): attends to its stream's cache so far — causally, as
  one key range, when that cache is one extent running up to it in the same region (the common
  case), else to the cache's extents as a base and causally to its own tokens;
- a question's prefill or one decode step: attends to a snapshot (`base`, only read) and
  causally to its own scratch tokens.

The dense layers (projections, MLP) see all tokens of all items at once. Attention is cut into
pieces — (query rows, a contiguous key range of the pool, causal or not) — that go through one
varlen flash-attention call per kind on CUDA (an extent is addressed by its start in the pool, so
many streams' caches are read in place, without copies), and the partial results merge by their
log-sum-exps. A base is a piece per extent, and a long one read by few queries is split into
several pieces (split-KV), so a lone
question over a 100K-token cache still fills the GPU. On the CPU the same pieces run one by one
in fp32: that path is the oracle's.

Positions are always explicit (see positions.py), so nothing here depends on how transformers'
generate() or Cache classes infer them in a given release.

KV layout: (layers, 2, kv_heads, slots, head_dim); [:, 0] keys (stored rotated), [:, 1] values.
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, groupby, repeat
from operator import itemgetter
from typing import NamedTuple

import torch
import torch.nn.functional as F

from common.engine.fp8 import Weight, cat_rows, linear, row_slice, set_weight, warn_emulated, weight_of
from common.engine.interleave import between_layers
from common.engine.model import LoadedModel
from common.engine.pool import KVPool, Region
from common.engine.positions import apply_rope, rope_cos_sin

# A base shorter than this is read whole (a piece's merge would cost more than it saves). At 8,192,
# a lone question over a cache just short of 8K read it on 2-4 SMs and was slower than one over
# 32K (first token 12.2 against 7.0 ms, decode 140 against 282 tok/s: issue 40). Above it the
# split depends on the batch only, never on the length, so graphs captured at one length serve all.
SPLIT_KV_MIN_TOKENS = 1024
# Decode rows over long bases are cut into pieces too, and go through our Triton kernel
# (decode_attention.py) where Triton is: a program per piece and KV head, no copies, no combine of
# flash's own (A/B runs with either off, when both were switches: docs/BENCHMARKS-history.md)
DECODE_BLOCKS_PER_SM = 8  # pieces x KV heads x rows per SM: several waves, so the last one is short


@dataclass(frozen=True)
class BodyPolicy:
    """Chunk prefill over a long cache: the cache's "body" (all but its last < `bucket` tokens) goes
    through cuDNN's attention, ~1.75x flash's rate on Hopper (640 vs 364 TFLOP/s at 16 chunks over
    32K), the rest and the chunk's own causal part through flash, merged by log-sum-exp. cuDNN
    builds a graph per shape (~50 ms), so bodies are whole buckets: one graph per (rows, bucket),
    each built once. Each chunk's body is read where it lies in the pool, cut into a few pieces
    along the keys so that one chunk's call fills the GPU (64 thread blocks a chunk and piece).
    Where cuDNN's attention does not run (a CPU, an old GPU), chunks read their whole cache
    through flash. The engine's setting (`LanguageModel.bodies`): sizes that pay on an H200;
    tests shrink them to reach the path with short caches."""

    min_tokens: int = 8192  # a cache shorter than this has no body
    bucket: int = 4096  # bodies are whole buckets
    min_items: int = 4  # chunks in the batch, at least
    min_rows: int = 64  # new tokens of each chunk, at least
    max_splits: int = 4  # pieces one body is cut into, at most


@dataclass(frozen=True)
class KVView:
    """A cache's tokens in order: held slot ranges of the pool (`extents`, see pool.py), usually one.
    Writers only ever write slots no view holds, or copy first (see kvcache.py), so a view is an
    immutable snapshot for as long as someone holds it (and it holds its pages)."""

    extents: tuple[Region, ...]

    @property
    def length(self) -> int:
        return sum(e.size for e in self.extents)

    def read(self, start: int, n: int) -> torch.Tensor:
        """K/V of tokens `start .. start + n` (layers, 2, kv_heads, n, hd): a view when they are in
        one extent, else a copy."""
        parts, at = [], 0
        for e in self.extents:
            lo, hi = max(start - at, 0), min(start + n - at, e.size)
            if lo < hi:
                parts.append(e.kv[:, :, :, lo:hi])
            at += e.size
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)

    @property
    def kv(self) -> torch.Tensor:
        """Every token's K/V in order (a view for one extent)."""
        return self.read(0, self.length)


@dataclass(frozen=True)
class Item:
    """`n` new tokens written to `dest` at slot `at`; they attend to all of `base` when given, then
    causally to dest[since:at + n] (what the region holds before them, and their own tokens)."""

    n: int
    dest: Region
    at: int
    base: KVView | None = None
    since: int = 0


# One attention piece as planned on the host: query rows row0 .. row0 + n_rows read the keys in
# slots start .. start + length of one slab. A plain tuple, not a NamedTuple: a decode step of 8
# questions plans 520 of them in Python every step, and a NamedTuple takes 6x a tuple's time to make.
HostPiece = tuple[int, int, int, int]  # (row0, n_rows, start, length)
Tap = Callable[[int, torch.Tensor], None]  # (layer, its queries (T, H, hd)), see LanguageModel.forward


class PieceKey(NamedTuple):
    """Which attention call a plan's pieces go through: the slab their keys lie in, and whether they
    are causal (an item's own tokens) or not (a base, read whole)."""

    slab: int
    causal: bool


@dataclass
class Pieces:
    """One PieceKey's pieces, P of them over R piece rows, as device index tensors (views of a plan's buffers)."""

    rows: torch.Tensor  # (R,) int64 query row of each piece row (pieces back to back)
    cu_q: torch.Tensor  # (P + 1,) int32 offsets of each piece's rows in `rows`
    cu_q_packed: torch.Tensor  # (P + 1,) int32 cu_q times the query heads per KV head (GQA rows packed, see _flash)
    starts: torch.Tensor  # (P + 1,) int32 first key slot of each piece (last entry unused)
    lengths: torch.Tensor  # (P,) int32 keys of each piece (0 = an empty split)
    host: list[HostPiece]  # (P,) the same pieces on the host, for the CPU path
    max_k: int  # at least the longest key range, a power of two (flash sizes its work by it)
    copies: int  # rows are this many copies of every query row in order (0: any other layout)


Span = slice  # a run of one of a plan's buffers


class PieceSpans(NamedTuple):
    """Where one PieceKey's index tensors lie in a plan's buffers (each field as in Pieces)."""

    rows: Span  # of the int64 buffer
    cu_q: Span  # the rest of the int32 one
    cu_q_packed: Span
    starts: Span
    lengths: Span
    host: list[HostPiece]
    copies: int


class WriteSpans(NamedTuple):
    """Where one slab's K/V writes lie in a plan's int64 buffer: the i-th row listed goes to the i-th slot."""

    rows: Span | None  # (W,) the tokens to write, by row; None: all T rows in order (no gather)
    slots: Span  # (W,) the pool slot each goes to


class BodyItem(NamedTuple):
    """One chunk's cache body, read by cuDNN (see BodyPolicy)."""

    start: int  # first slot: the item's region's start, where its cache begins
    tokens: int  # keys read, whole buckets (BodyPolicy.bucket)
    rows: int  # the item's query rows (its new tokens)


class Body(NamedTuple):
    """A chunk batch's bodies: all in one slab, each cut into `splits` pieces along the keys."""

    slab: int
    splits: int
    items: tuple[BodyItem, ...]  # one per item, in row order


@dataclass
class Plan:
    """Indices of one batch: where each token's K/V go and which key ranges each query row reads.
    Fixed shapes for a fixed batch structure, so a step can be a CUDA graph. Every index lives in
    one of two buffers (int64, int32) and is a view of it, so moving a plan to the device, or
    into a graph's buffers, is two copies and no host sync."""

    longs: torch.Tensor  # (L,) int64: write rows and slots, then each PieceKey's piece rows
    ints: torch.Tensor  # (I,) int32: each PieceKey's cu_q, cu_q_packed, starts and lengths
    write_spans: dict[int, WriteSpans]  # by slab
    piece_spans: dict[PieceKey, PieceSpans]
    n_rows: int  # T: the batch's tokens (query rows), every item's back to back
    max_q: int  # the most rows of one item
    body: Body | None = None  # never graphed, so host ints
    # the least max_k of causal (own) and non-causal (base) pieces: a graph's, so that caches
    # growing within it keep one graph (see StepGraphs)
    max_k_floor: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        longs, ints = self.longs, self.ints
        # slab -> (rows (W,) int64 or None = all T in order, slots (W,) int64)
        self.writes = {
            slab: (None if w.rows is None else longs[w.rows], longs[w.slots]) for slab, w in self.write_spans.items()
        }
        floors = {True: self.max_k_floor[0], False: self.max_k_floor[1]}
        self.pieces = {
            key: Pieces(
                longs[s.rows],
                ints[s.cu_q],
                ints[s.cu_q_packed],
                ints[s.starts],
                ints[s.lengths],
                s.host,
                _max_k(s.host, floors[key.causal]),
                s.copies,
            )
            for key, s in self.piece_spans.items()
        }
        # every row's pieces stacked alike: the merge is a reduction over a stack, no scatter
        self.stacked = all(p.copies for p in self.pieces.values())
        # the bodies' output rows: every row in order, once per piece of the body (as its own piece)
        self.body_rows = None  # (splits * T,) int64
        if self.body is not None:
            self.body_rows = self.pieces[PieceKey(self.body.slab, True)].rows.repeat(self.body.splits)

    def to(self, device: torch.device) -> Plan:
        longs, ints = (t.to(device, non_blocking=True) for t in (self.longs, self.ints))
        return Plan(
            longs, ints, self.write_spans, self.piece_spans, self.n_rows, self.max_q, self.body, self.max_k_floor
        )

    @property
    def shape(self) -> tuple:
        """What a CUDA graph of this plan depends on besides its index values."""
        body = None if self.body is None else (self.body.splits, tuple((b.tokens, b.rows) for b in self.body.items))
        return (*((key, p.max_k, len(p.host)) for key, p in self.pieces.items()), body)

    @property
    def single_slab(self) -> int | None:
        """The one slab every write and read of this batch is in (the usual case on a GPU)."""
        slabs = set(self.writes) | {key.slab for key in self.pieces} | ({self.body.slab} if self.body else set())
        return slabs.pop() if len(slabs) == 1 else None


class _Packer:
    """Index lists laid out back to back in an int64 and an int32 buffer; spans name the views."""

    def __init__(self) -> None:
        self.longs: list[int] = []
        self.ints: list[int] = []

    def long(self, values: list[int]) -> slice:
        self.longs += values
        return slice(len(self.longs) - len(values), len(self.longs))

    def int(self, values: list[int]) -> slice:
        self.ints += values
        return slice(len(self.ints) - len(values), len(self.ints))


class LanguageModel:
    def __init__(self, loaded: LoadedModel, pool: KVPool):
        text = loaded.model.model.language_model
        cfg = loaded.text_config
        if cfg.hidden_act != "silu":
            raise ValueError(f"MLP activation {cfg.hidden_act!r}: only silu is implemented")
        self.layers = text.layers
        self.norm = text.norm
        self.embed_tokens = text.embed_tokens
        self.lm_head = loaded.model.lm_head
        self.inv_freq = text.rotary_emb.inv_freq  # (hd / 2,)
        self.mrope_section = loaded.mrope_section
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.n_layers = cfg.num_hidden_layers
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.pool = pool
        self.flash = self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
        self.bodies = BodyPolicy()
        self.cudnn = self.flash and _cudnn_attention_works(self.device, self.dtype, self.head_dim)
        self.decode_kernel, self.decode_combine = _decode_kernels(self.head_dim) if self.flash else (None, None)
        with torch.no_grad():
            self.weights = [_LayerWeights.of(layer) for layer in self.layers]
        warn_emulated("language model", [x for w in self.weights for x in (w.qkv, w.o, w.gate_up, w.down)], self.device)
        self.eps = self.norm.variance_epsilon
        self._attention_input, self._output_and_mlp = _attention_input, _output_and_mlp
        self._merge, self._merge_stacked = _merge, _merge_stacked
        if self.device.type == "cuda" and FUSE:
            # Tensors only, dynamic in their token count alone (see tokens_vary): one compiled graph
            # serves every layer and every batch; each fuses the elementwise chains around the
            # matrix products.
            # The merges compile once per piece count (their loop over parts unrolls): split-KV
            # factors, cache tails and bodies make more than dynamo's default of 8, past which
            # each new count silently runs eager (seen at 64 cameras once caches were full).
            from torch._dynamo import config  # here: only GPU services compile, and it is slow to import

            config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
            self._attention_input = torch.compile(_attention_input)
            self._output_and_mlp = torch.compile(_output_and_mlp)
            self._merge = torch.compile(_merge, dynamic=True)
            self._merge_stacked = torch.compile(_merge_stacked, dynamic=True)

    @torch.inference_mode()
    def embed(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids)
        return self.embed_tokens(ids.to(self.device, non_blocking=True))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def split_for(self, n_items: int, rows_per_item: int, base_tokens: int, n_sm: int = 132) -> int:
        """Split-KV factor for items of up to `rows_per_item` query rows over bases of up to
        `base_tokens`. Flash attention runs a thread block per query head and piece for one-row
        items (and splits the keys further itself), and one per KV head and 128 packed rows for
        more (see _flash); a handful of questions over a long cache needs its bases cut into
        pieces to keep every SM busy (twice over), while many questions fill it with one each."""
        if not self.flash or base_tokens < SPLIT_KV_MIN_TOKENS:
            return 1
        group = self.n_heads // self.n_kv_heads
        if rows_per_item == 1 and self.decode_kernel is not None:  # a program per piece and KV head
            return max(1, min(DECODE_MAX_SPLIT, (DECODE_BLOCKS_PER_SM * n_sm) // (n_items * self.n_kv_heads)))
        blocks = self.n_heads if rows_per_item == 1 else self.n_kv_heads * -(-rows_per_item * group // 128)
        split = max(1, min(MAX_SPLIT, (2 * n_sm) // (n_items * blocks)))
        # A split prefill has at least UNROLL_COPIES pieces, so its merge is always the stacked one:
        # one compiled variant for every batch size and length, where each few-pieces count compiled
        # its own, a stall of seconds the first time a batch shape came up while serving (8.8 s, H200)
        return split if rows_per_item == 1 or split == 1 else max(split, UNROLL_COPIES)

    def plan(
        self, items: list[Item], split: int = 1, device: bool = True, max_k_floor: tuple[int, int] = (0, 0)
    ) -> Plan:
        """Indices for `items`; a base is cut into `split` pieces (split-KV) when it is long. With
        `device=False` the buffers stay in host memory (to be copied into a graph's)."""
        writes: dict[int, tuple[list[int], list[int]]] = {}  # slab -> (token rows, slots)
        # keyed (slab, causal) as plain tuples, made a PieceKey once each below (one per call, not item)
        pieces: dict[tuple[int, bool], list[HostPiece]] = {}
        bases: dict[tuple[int, bool], list[list[HostPiece]]] = {}  # each item's base pieces
        bodies = self._bodies(items)
        row = 0
        for k, it in enumerate(items):
            if it.at + it.n > it.dest.size:
                raise ValueError(f"region of {it.dest.size} tokens too small for {it.at + it.n}")
            rows, slots = writes.setdefault(it.dest.slab, ([], []))
            rows += range(row, row + it.n)
            slots += range(it.dest.start + it.at, it.dest.start + it.at + it.n)
            lo = it.since + (bodies[k] if bodies else 0)  # after the body, if any
            own = (row, it.n, it.dest.start + lo, it.at + it.n - lo)
            read = {} if it.base is None else _base_pieces(row, it.n, it.base, split)
            if it.n == 1 and read and split > 1:  # see _own_beside_base
                read.setdefault(it.dest.slab, []).append(own)
            else:
                pieces.setdefault((it.dest.slab, True), []).append(own)
            for slab, item_pieces in read.items():
                bases.setdefault((slab, False), []).append(item_pieces)
            row += it.n
        if split > 1 and any(it.n == 1 and it.base is not None for it in items):  # own pieces among the bases
            max_k_floor = (max_k_floor[0], max(max_k_floor))
        for key, per_item in bases.items():  # split-major: piece s of every item, then piece s + 1
            longest = max(len(own) for own in per_item)
            per_item = [own + [(*own[0][:3], 0)] * (longest - len(own)) for own in per_item]  # empty: same count
            pieces[key] = [piece for same_split in zip(*per_item, strict=True) for piece in same_split]
        pack = _Packer()
        write_spans = {
            slab: WriteSpans(None if len(rows) == row else pack.long(rows), pack.long(slots))  # all in order: no gather
            for slab, (rows, slots) in writes.items()
        }
        piece_spans = {PieceKey(*key): self._piece_spans(pack, host, row) for key, host in pieces.items()}
        body_span = None
        if bodies:
            splits = _body_splits(self.device, min(it.n for it in items), self.n_heads, self.n_kv_heads, self.bodies)
            body_span = Body(
                items[0].dest.slab,
                splits,
                tuple(BodyItem(it.dest.start, b, it.n) for it, b in zip(items, bodies, strict=True)),
            )
        plan = Plan(
            _tensor(pack.longs, "q", torch.long),
            _tensor(pack.ints, "i", torch.int32),
            write_spans,
            piece_spans,
            row,
            max(it.n for it in items),
            body_span,
            max_k_floor,
        )
        return plan.to(self.device) if device else plan

    # _own_beside_base: one query row sees every key of its own, causal or not, so with split-KV
    # a decode row's own keys are one more piece of its base's flash call (one call and combine a
    # layer fewer, no second part to merge: a lone decode at 100K went from 155 to 180 tok/s,
    # H200). Unsplit (many questions at once) they stay a call of their own: tiny pieces beside
    # whole bases made flash split each base less (attention at 32 questions: 9.6 -> 10.4 ms).

    def _bodies(self, items: list[Item]) -> list[int] | None:
        """Tokens of each item's cache that cuDNN reads (see BodyPolicy), or None: only for a
        batch of enough chunks (no base) of one slab, each after a long cache, so that every row
        has a body and the merge stays stacked."""
        if not self.cudnn or len(items) < self.bodies.min_items:
            return None
        slab = items[0].dest.slab
        if any(it.base is not None or it.since or it.n < self.bodies.min_rows or it.dest.slab != slab for it in items):
            return None
        bucket = self.bodies.bucket
        bodies = [it.at // bucket * bucket for it in items]
        return bodies if min(bodies) >= self.bodies.min_tokens else None

    def _piece_spans(self, pack: _Packer, host: list[HostPiece], n_rows: int) -> PieceSpans:
        # column by column (a decode step of 8 questions plans 520 pieces, in Python, every step)
        first_rows, counts, starts, lengths = zip(*host, strict=True)
        cu_q = [0, *accumulate(counts)]
        group = self.n_heads // self.n_kv_heads
        rows = list(first_rows) if max(counts) == 1 else [r for r0, n, _, _ in host for r in range(r0, r0 + n)]
        copies = len(rows) // n_rows
        return PieceSpans(
            pack.long(rows),
            pack.int(cu_q),
            pack.int([c * group for c in cu_q]),
            pack.int([*starts, 0]),
            pack.int(list(lengths)),
            host,
            copies if rows == list(range(n_rows)) * copies else 0,
        )

    @torch.inference_mode()
    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, plan: Plan, tap: Tap | None = None
    ) -> torch.Tensor:
        """Run `embeds` (T, D) at `positions` (3, T) as `plan` says; writes their K/V into the pool
        and returns the final-norm hidden states (T, D). `tap(layer, q)` sees each layer's queries
        (T, H, hd), rotated (retrieval features: features.py)."""
        h = self._layers(embeds, positions, plan, tap=tap)
        assert h is not None
        return h

    @torch.inference_mode()
    def write_kv(self, embeds: torch.Tensor, positions: torch.Tensor, plan: Plan) -> None:
        """`forward` for work that wants only its K/V in the pool (a chunk, a prompt prefix): the
        last layer stops once it has written them, since its attention and MLP would only feed
        logits that nobody reads (1/36 of a 3B model's prefill)."""
        self._layers(embeds, positions, plan, last=self.n_layers - 1)

    @torch.inference_mode()
    def queries(self, embeds: torch.Tensor, positions: torch.Tensor, plan: Plan, tap: Tap, last: int) -> None:
        """`forward` as far as layer `last`'s queries, each layer's seen by `tap` (a question's
        retrieval vector, features.py): the layers after it would feed logits nobody reads."""
        self._layers(embeds, positions, plan, last=last, tap=tap)

    def _layers(
        self, embeds: torch.Tensor, positions: torch.Tensor, plan: Plan, last: int | None = None, tap: Tap | None = None
    ) -> torch.Tensor | None:
        """The layers, to the final norm's hidden states; with `last`, only until that layer has
        written its K/V (and shown `tap` its queries)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.mrope_section, self.dtype)  # (T, hd) each
        x = embeds.to(self.dtype)  # (T, D): the residual stream
        h = _rms_norm_weight(x, self.weights[0].norm1, self.eps)  # (T, D): x normed for the next layer
        norms = [w.norm1 for w in self.weights[1:]] + [self.norm.weight]
        for i, (w, next_norm) in enumerate(zip(self.weights, norms, strict=True)):
            between_layers()
            tokens_vary(h, cos, sin)
            # q (T, H, hd), kv (2, kv_heads, T, hd)
            q, kv = self._attention_input(h, w.qkv, w.qkv_bias, cos, sin, self.n_heads, self.n_kv_heads)
            self._write(i, kv, plan)
            if tap is not None:
                tap(i, q)
            if i == last:
                return None
            attended = self._attention(i, q, plan)  # (T, H, hd)
            tokens_vary(x, attended)
            x, h = self._output_and_mlp(x, attended, w.o, w.norm2, w.gate_up, w.down, next_norm, self.eps)
        return h

    def _write(self, i: int, kv: torch.Tensor, plan: Plan) -> None:
        """K/V (2, kv_heads, T, hd) of layer `i` into the pool, where the plan says."""
        for slab, (rows, slots) in plan.writes.items():
            self.pool.slabs[slab][i].index_copy_(2, slots, kv if rows is None else kv.index_select(2, rows))

    def _attention(self, i: int, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        """q (T, H, hd) -> attended (T, H, hd), over layer `i`'s keys (its own written first)."""
        parts = [  # (out (R, H, hd), lse (R, H), rows (R,)) of each call
            self._piece_attention(q, self.pool.slabs[key.slab][i], p, key.causal, plan.max_q)
            for key, p in plan.pieces.items()
        ]
        if (body := plan.body) is not None:  # every row in order, as its own piece is: the merge stays stacked
            layer = self.pool.slabs[body.slab][i]
            out, lse = cudnn_body_attention(q, layer, body.items, body.splits, self.head_dim**-0.5)
            parts.append((out, lse, plan.body_rows))
        if not plan.stacked:
            return self._merge(q.shape[0], parts)
        (out, lse, _), n_rows = parts[0], q.shape[0]
        if len(parts) == 1 and out.shape[0] > n_rows and plan.max_q == 1 and self.decode_combine is not None:
            return self.decode_combine(out, lse, n_rows)  # decode rows' split pieces, from decode_kernel
        return self._merge_stacked(n_rows, parts)

    def _piece_attention(self, q, kv, p: Pieces, causal: bool, max_q: int):
        """(out (R, H, hd), lse (R, H), rows (R,)) for every piece row."""
        if max_q == 1 and self.decode_kernel is not None:  # one query row a piece (set on GPUs only)
            return (*self.decode_kernel(q, kv, p.rows, p.starts, p.lengths, self.head_dim**-0.5), p.rows)
        if self.flash:
            q = q if p.copies == 1 else q.index_select(0, p.rows)
            return (*self._flash(q, kv, p, causal, max_q), p.rows)
        outs, lses = [], []
        for r0, n, start, length in p.host:
            o, lse = self._cpu_attention(q[r0 : r0 + n], kv[:, :, start : start + length], causal)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses), p.rows

    def _flash(self, q: torch.Tensor, kv: torch.Tensor, p: Pieces, causal: bool, max_q: int):
        """Varlen flash attention of q (R, H, hd) over the pieces' key ranges of one slab layer.

        A non-causal piece (a base) read by several query rows has the query heads that share a
        KV head packed as rows (GQA packing: (R, H) -> (R * group, kv_heads)), so each KV block is
        read once per block of rows instead of once per query head; flash does this itself for
        single-row queries (decode). An empty piece gives lse +inf in flash: -inf here."""
        rows, group = q.shape[0], self.n_heads // self.n_kv_heads
        packed = not causal and max_q > 1 and group > 1
        if packed:
            q = (
                q.view(rows, self.n_kv_heads, group, self.head_dim)
                .transpose(1, 2)
                .reshape(-1, self.n_kv_heads, self.head_dim)
            )
        out, lse = torch.ops.aten._flash_attention_forward(
            q,
            kv[0].transpose(0, 1),  # (slots, kv_heads, hd): a strided view, read in place
            kv[1].transpose(0, 1),
            p.cu_q_packed if packed else p.cu_q,
            p.starts,
            max_q * group if packed else max_q,
            p.max_k,
            0.0,
            causal,
            False,
            scale=self.head_dim**-0.5,
            seqused_k=p.lengths,
        )[:2]
        if packed:
            out = out.view(rows, group, self.n_kv_heads, self.head_dim).transpose(1, 2).reshape(rows, self.n_heads, -1)
            lse = lse.view(self.n_kv_heads, rows, group).transpose(0, 1).reshape(rows, self.n_heads)
        else:
            lse = lse.transpose(0, 1)  # (H, R) -> (R, H)
        return out, lse

    def _cpu_attention(self, q: torch.Tensor, kv: torch.Tensor, causal: bool):
        """Exact fp32 attention of q (n, H, hd) over kv (2, kv_heads, L, hd), causal aligned bottom-right."""
        n, length = q.shape[0], kv.shape[2]
        if length == 0:
            return torch.zeros_like(q), torch.full((n, self.n_heads), -math.inf, device=q.device)
        rep = self.n_heads // self.n_kv_heads
        k = kv[0].float().repeat_interleave(rep, 0)
        v = kv[1].float().repeat_interleave(rep, 0)
        scores = (q.float().transpose(0, 1) @ k.transpose(-1, -2)) * self.head_dim**-0.5  # (H, n, L)
        if causal:
            seen = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
            scores = scores.masked_fill(~seen.to(q.device), -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # (H, n)
        out = torch.exp(scores - lse[..., None]) @ v  # (H, n, hd)
        return out.transpose(0, 1).to(q.dtype), lse.transpose(0, 1)


def cudnn_body_attention(
    q: torch.Tensor, layer: torch.Tensor, bodies: tuple[BodyItem, ...], splits: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of each item's query rows over its cache's body, through cuDNN, the
    keys read where they lie in the pool (a batched copy of every body first cost 8 % of an encode
    step's device time at 64 cameras, H200).

    q (R, H, hd), items' rows back to back; `layer` one slab layer (2, kv_heads, slots, hd);
    `bodies` one BodyItem per item. An item's body is cut into `splits` equal
    pieces along the keys (`_body_splits`), each a batch entry of one call (a strided view: no
    copy), and the query heads that share a KV head are packed as rows, so one item's call has
    enough thread blocks to fill the GPU. -> out (splits * R, H, hd), lse (splits * R, H):
    `splits` parts per row, in row order each, to be merged by log-sum-exp."""
    heads, hd = q.shape[1:]
    kv_heads = layer.shape[1]
    group = heads // kv_heads
    outs, lses, r0 = [], [], 0
    # Items of one row count (a run of chunks of one grid) share one copy for their queries and
    # two for their outputs: per item these were five small copies a layer, launched from Python
    # one by one, most of a chunk prefill's host time between kernels (64 cameras, H200)
    for n, run in groupby(bodies, key=lambda body: body.rows):
        run = list(run)
        m = len(run)
        packed = (  # (m, splits, kv_heads, n * group, hd): each item's query heads of a KV head as rows, per piece
            q[r0 : r0 + m * n]
            .view(m, 1, n, kv_heads, group, hd)
            .permute(0, 1, 3, 2, 4, 5)
            .expand(m, splits, kv_heads, n, group, hd)
            .reshape(m, splits, kv_heads, n * group, hd)
        )
        item_outs, item_lses = [], []
        for j, (start, length, _) in enumerate(run):
            k, v = layer[:, :, start : start + length].unflatten(2, (splits, length // splits)).transpose(1, 2)
            out, lse = _cudnn_attention(packed[j], k, v, scale)
            item_outs.append(out)
            item_lses.append(lse)
        out = torch.stack(item_outs).view(m, splits, kv_heads, n, group, hd)
        lse = torch.stack(item_lses).view(m, splits, kv_heads, n, group)
        outs.append(out.permute(1, 0, 3, 2, 4, 5).reshape(splits, m * n, heads, hd))
        lses.append(lse.permute(1, 0, 3, 2, 4).reshape(splits, m * n, heads))
        r0 += m * n
    rows = q.shape[0]
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, dim=1), torch.cat(lses, dim=1))
    return out.view(splits * rows, heads, hd), lse.view(splits * rows, heads)


def _cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """cuDNN's non-causal attention with its log-sum-exp: q (B, H, S, hd), k and v (B, H, L, hd)
    -> out (B, H, S, hd), lse (B, H, S) in fp32."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)[:2]


def _body_splits(device: torch.device, rows: int, heads: int, kv_heads: int, bodies: BodyPolicy) -> int:
    """Pieces the body of an item of `rows` query rows is cut into: cuDNN runs a thread block per
    KV head, 128 packed query rows (GQA heads as rows) and piece; enough pieces for about one
    block per SM (2 for a 448² chunk on an H200), a power of two that divides the bucket."""
    blocks = kv_heads * -(-rows * heads // kv_heads // 128)
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    splits = 1
    while splits < bodies.max_splits and bodies.bucket % (splits * 2) == 0:
        if blocks * splits * 2 > n_sm + blocks // 2:
            break
        splits *= 2
    return splits


def _cudnn_attention_works(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this torch, cuDNN and GPU run cuDNN's attention as the bodies do (keys read in place
    from a pool-like layer) at this head size (else flash only)."""
    try:
        q = torch.zeros(64, 2, head_dim, device=device, dtype=dtype)
        bodies = BodyPolicy()
        layer = torch.zeros(2, 1, 2 * bodies.bucket, head_dim, device=device, dtype=dtype)
        splits = _body_splits(device, 64, 2, 1, bodies)
        cudnn_body_attention(q, layer, (BodyItem(bodies.bucket // 2, bodies.bucket, 64),), splits, 1.0)
    except RuntimeError:
        return False
    return True


def _base_pieces(row: int, n: int, base: KVView, split: int) -> dict[int, list[HostPiece]]:
    """A base's pieces for query rows `row .. row + n`, by slab: each extent cut by its share of
    `split` (one extent: exactly `split` pieces)."""
    pieces: dict[int, list[HostPiece]] = {}  # by slab
    total = max(base.length, 1)
    for e in base.extents:
        share = split if len(base.extents) == 1 else max(1, math.ceil(split * e.size / total))
        pieces.setdefault(e.slab, []).extend(_split(row, n, e.start, e.size, share))
    return pieces


def _split(row: int, n: int, start: int, length: int, split: int) -> list[HostPiece]:
    """A base's key range as `split` pieces for the same query rows (split-KV); empty pieces stay,
    so a batch's structure (and its CUDA graph) does not depend on the lengths."""
    if split == 1:
        return [(row, n, start, length)]
    step = max(math.ceil(length / split), 1)
    full, rest = divmod(length, step)  # pieces of `step` keys, then one of the rest, then empty ones
    lengths = [step] * min(full, split) + ([rest] if rest and full < split else [])
    lengths += [0] * (split - len(lengths))
    return list(zip(repeat(row), repeat(n), range(start, start + split * step, step), lengths))


MAX_SPLIT = 64
DECODE_MAX_SPLIT = 64  # the Triton decode kernel's pieces of one row's base


def _decode_kernels(head_dim: int):
    """decode_attention's piece_attention and combine, or Nones where Triton is not installed or
    the head width is no power of two from 16 (flash and the compiled merges serve)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return None, None
    try:
        from common.engine.decode_attention import combine, piece_attention
    except ImportError:
        return None, None
    return piece_attention, combine


def _merge(n_rows: int, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax over the union of every piece a row read, from each piece's output and log-sum-exp.
    A piece with no keys has lse -inf (+inf from flash, which writes zeros to its output)."""
    outs = torch.cat([o for o, _, _ in parts]).float()
    lses = torch.cat([lse for _, lse, _ in parts])  # (R, H)
    lses = lses.masked_fill(lses == math.inf, -math.inf)
    rows = torch.cat([r for _, _, r in parts])
    heads = lses.shape[1]
    peak = torch.full((n_rows, heads), -math.inf, device=lses.device).scatter_reduce(
        0, rows[:, None].expand(-1, heads), lses, "amax"
    )
    weight = torch.exp(lses - peak.index_select(0, rows))  # 0 for empty pieces
    total = torch.zeros(n_rows, heads, device=lses.device).index_add_(0, rows, weight)
    out = torch.zeros(n_rows, heads, outs.shape[-1], device=outs.device).index_add_(0, rows, outs * weight[..., None])
    return (out / total[..., None]).to(parts[0][0].dtype)


UNROLL_COPIES = 8  # a stacked merge of at most this many copies in all sums them one by one


def _merge_stacked(n_rows: int, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`_merge` where every part's rows are whole copies of rows 0..n_rows-1 in order (a plan's
    `stacked`): a sum over every copy. One piece per row is already the answer.
    Part by part, never concatenated: compiled, a chunk batch's merge (own piece, cache tail,
    cuDNN body: 4096 rows x 16 heads each) is one pass over the parts, where a cat first and a
    reduction after read everything twice, at 380 us a layer.
    How the copies are summed depends on how many there are, as the compiler makes each (H200):
    a few (a chunk batch, a decode batch without split-KV), each copy a tensor of its own, are one
    pointwise kernel, where a reduction over a copy dimension of symbolic size made a kernel of
    one output per program (10 ms a layer at 16 chunks); many (a question's prefill over a long
    cache, 64 pieces), unrolled, made a kernel 8 ms slower a prefill than the reduction."""
    if len(parts) == 1 and parts[0][0].shape[0] == n_rows:
        return parts[0][0]
    heads, head_dim = parts[0][0].shape[1:]
    outs = [o.view(-1, n_rows, heads, head_dim) for o, _, _ in parts]
    lses = [lse.view(-1, n_rows, heads) for _, lse, _ in parts]
    if sum(o.shape[0] for o in outs) <= UNROLL_COPIES:
        return _merge_copies([c for o in outs for c in o.unbind(0)], [c for lse in lses for c in lse.unbind(0)])
    return _merge_stacks(outs, lses)


def _merge_copies(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Outputs (rows, heads, dim) and log-sum-exps (rows, heads) of pieces of the same rows."""
    lses = [lse.masked_fill(lse == math.inf, -math.inf) for lse in lses]
    peak = functools.reduce(torch.maximum, lses)
    weights = [torch.exp(lse - peak) for lse in lses]
    total = functools.reduce(torch.add, weights)
    out = functools.reduce(torch.add, [o.float() * w[..., None] for o, w in zip(outs, weights, strict=True)])
    return (out / total[..., None]).to(outs[0].dtype)


def _merge_stacks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """`_merge_copies` of stacks of copies: (copies, rows, heads, dim) and (copies, rows, heads)."""
    lses = [lse.masked_fill(lse == math.inf, -math.inf) for lse in lses]
    peak = lses[0].amax(0)
    for lse in lses[1:]:
        peak = torch.maximum(peak, lse.amax(0))
    weights = [torch.exp(lse - peak) for lse in lses]
    total = sum(w.sum(0) for w in weights)
    out = sum((o.float() * w[..., None]).sum(0) for o, w in zip(outs, weights, strict=True))
    return (out / total[..., None]).to(outs[0].dtype)


def _tensor(values: list[int], typecode: str, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of `values` through a C array: a tenth of torch.tensor's time on a list."""
    return torch.frombuffer(array(typecode, values), dtype=dtype) if values else torch.empty(0, dtype=dtype)


def _max_k(host: list[HostPiece], floor: int = 0) -> int:
    """The longest key range (or `floor`, if more), rounded up to a power of two: flash sizes its
    work by it, and its split-KV path reads no key past it."""
    return 1 << max(8, (max(floor, max(map(itemgetter(3), host))) - 1).bit_length())


def tokens_vary(*tensors: torch.Tensor) -> None:
    """Tell torch.compile that only these tensors' first size (tokens) varies between calls, so
    that every other size (hidden, heads, MLP width) is a constant of the compiled kernels: with
    every size symbolic (`dynamic=True`) their loads did not vectorise, and the LM's silu(gate) *
    up ran at 2.0-2.5x the time of the same kernel with its widths known (H200)."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _rms_norm_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2.5-VL's RMSNorm (fp32 statistics, weight applied in the model dtype) in one fused op."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    return _rms_norm_weight(x, norm.weight, norm.variance_epsilon)


RECOMPILE_LIMIT = 64  # compiled graphs per merge function (one per piece count)
FUSE = True  # torch.compile the elementwise chains of a layer on GPUs (off: the same functions, eager)


@dataclass
class _LayerWeights:
    """One decoder layer's weights as the fused forward takes them: q, k and v as one matrix and
    gate and up as another (one product each instead of three and two). The modules' own
    weights become views of these, so nothing is stored twice. With `gemm_dtype: fp8` the
    products' weights are FP8Weights (fp8.py): their rows keep their scales when fused."""

    norm1: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    norm2: torch.Tensor
    gate_up: Weight
    down: Weight

    @classmethod
    def of(cls, layer) -> _LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, _ = _fuse_linears([mlp.gate_proj, mlp.up_proj])
        for name, lin in (("o_proj", attn.o_proj), ("down_proj", mlp.down_proj)):
            if lin.bias is not None:
                raise ValueError(f"{name} with a bias: not Qwen2.5-VL's layout")
        return cls(
            layer.input_layernorm.weight,
            qkv,
            qkv_bias,
            weight_of(attn.o_proj),
            layer.post_attention_layernorm.weight,
            gate_up,
            weight_of(mlp.down_proj),
        )


def _fuse_linears(linears: list[torch.nn.Module]) -> tuple[Weight, torch.Tensor | None]:
    weight = cat_rows([weight_of(lin) for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        raise ValueError("some of the fused projections have a bias and some not")
    row = 0
    for lin in linears:
        n = lin.out_features
        set_weight(lin, row_slice(weight, row, row + n))
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


def _attention_input(h, qkv_w, qkv_b, cos, sin, n_heads: int, n_kv_heads: int):
    """Normed hidden (T, D) -> q (T, H, hd) rotated, and K/V (2, kv_heads, T, hd) as the pool lays
    them out (k rotated): written with one indexed copy, where k and v apart took four kernels."""
    n = h.shape[0]
    head_dim = cos.shape[-1]
    q, k, v = linear(h, qkv_w, qkv_b).split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], -1)
    cos, sin = cos[:, None], sin[:, None]
    q = apply_rope(q.view(n, n_heads, head_dim), cos, sin)
    k = apply_rope(k.view(n, n_kv_heads, head_dim), cos, sin)
    return q, torch.stack((k, v.view(n, n_kv_heads, head_dim))).transpose(1, 2).contiguous()


def _output_and_mlp(x, attended, o_w, norm2, gate_up_w, down_w, next_norm, eps: float):
    """The rest of a layer and the next one's input norm: (x, normed x) after it.
    The residual products are taken over a batch of one (3-D): compiled, `x + linear(2-D)` became
    an addmm, which copies x into its output before the product (two device copies a layer, a
    kernel each in every decode step); so the add fuses into the norm that reads x next."""
    x = x + linear(attended.reshape(1, x.shape[0], -1), o_w)[0]
    gate, up = linear(_rms_norm_weight(x, norm2, eps), gate_up_w).chunk(2, dim=-1)
    x = x + linear((F.silu(gate) * up)[None], down_w)[0]
    return x, _rms_norm_weight(x, next_norm, eps)
