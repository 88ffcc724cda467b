"""Our own forward pass of Qwen2.5-VL's language model, batched over streams and questions.

transformers' modules supply the weights and the per-layer maths (norms, projections, MLP);
this file owns the cache and the attention, because the cache is the product. Every cache lives
in a region of the device's KV pool (pool.py). One forward runs any mix of work, each item a few
new tokens written into its own region:

- a chunk of video (or the prompt prefix): attends causally to its stream's cache so far;
- a question's prefill or one decode step: attends to a snapshot (`base`, only read) and
  causally to its own scratch tokens.

The dense layers (projections, MLP) see all tokens of all items at once. Attention is cut into
pieces — (query rows, a contiguous key range of the pool, causal or not) — that go through one
varlen flash-attention call per kind on CUDA (a pool region is addressed by its start, so many
streams' caches are read in place, without copies), and the partial results merge by their
log-sum-exps. A long base read by few queries is split into several pieces (split-KV), so a lone
question over a 100K-token cache still fills the GPU. On the CPU the same pieces run one by one
in fp32: that path is the oracle's.

Positions are always explicit (see positions.py), so nothing here depends on how transformers'
generate() or Cache classes infer them in a given release.

KV layout: (layers, 2, kv_heads, slots, head_dim); [:, 0] keys (stored rotated), [:, 1] values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from common.engine.model import LoadedModel
from common.engine.pool import KVPool, Region
from common.engine.positions import apply_rope, rope_cos_sin

SPLIT_KV_MIN_TOKENS = 8192  # a base shorter than this is not worth splitting


@dataclass(frozen=True)
class KVView:
    """The first `length` tokens of a region. Writers only ever write past every view's length,
    so a view is an immutable snapshot for as long as someone holds it (and it holds the region)."""

    region: Region
    length: int

    @property
    def kv(self) -> torch.Tensor:
        return self.region.kv


@dataclass(frozen=True)
class Item:
    """`n` new tokens written to `dest` at slot `at`; they attend causally to dest[:at + n] (their
    own tokens and what the region holds before them), after all of `base` when given."""

    n: int
    dest: Region
    at: int
    base: KVView | None = None


@dataclass
class Plan:
    """Device-side indices of one batch: where each token's K/V go and which key ranges each query
    row reads. Fixed shapes for a fixed batch structure, so a decode step can be a CUDA graph."""

    writes: dict[int, tuple[torch.Tensor | None, torch.Tensor]]  # slab -> (token rows or None = all, slots)
    pieces: dict[tuple[int, bool], Pieces]  # (slab, causal) -> pieces
    max_q: int
    max_k: int  # the longest key range, rounded up to a power of two (flash sizes its work by it)

    @property
    def single_slab(self) -> int | None:
        """The one slab every write and read of this batch is in (the usual case on a GPU)."""
        slabs = set(self.writes) | {slab for slab, _ in self.pieces}
        return slabs.pop() if len(slabs) == 1 else None


@dataclass
class Pieces:
    rows: torch.Tensor  # (R,) query row of each piece row (pieces back to back)
    cu_q: torch.Tensor  # (P + 1,) int32 offsets of each piece's rows in `rows`
    starts: torch.Tensor  # (P + 1,) int32 first key slot of each piece (last entry unused)
    lengths: torch.Tensor  # (P,) int32 keys of each piece (0 = an empty split)
    empty_rows: torch.Tensor  # (R,) bool: the row's piece has no keys
    host: list[tuple[int, int, int, int]]  # (row0, n_rows, start, length) for the CPU path


class LanguageModel:
    def __init__(self, loaded: LoadedModel, pool: KVPool):
        text = loaded.model.model.language_model
        cfg = loaded.text_config
        self.layers = text.layers
        self.norm = text.norm
        self.embed_tokens = text.embed_tokens
        self.lm_head = loaded.model.lm_head
        self.inv_freq = text.rotary_emb.inv_freq
        self.mrope_section = loaded.mrope_section
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.n_layers = cfg.num_hidden_layers
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.pool = pool
        self.flash = self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)

    @torch.inference_mode()
    def embed(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=self.device)
        return self.embed_tokens(ids.to(self.device))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def plan(self, items: list[Item], split: int = 1) -> Plan:
        """Indices for `items`; a base is cut into `split` pieces (split-KV) when it is long."""
        writes: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        pieces: dict[tuple[int, bool], list[tuple[int, int, int, int]]] = {}
        row = 0
        for it in items:
            if it.at + it.n > it.dest.size:
                raise ValueError(f"region of {it.dest.size} tokens too small for {it.at + it.n}")
            rows = torch.arange(row, row + it.n)
            writes.setdefault(it.dest.slab, []).append((rows, rows - row + it.dest.start + it.at))
            pieces.setdefault((it.dest.slab, True), []).append((row, it.n, it.dest.start, it.at + it.n))
            if it.base is not None:
                key = (it.base.region.slab, False)
                pieces.setdefault(key, []).extend(_split(row, it.n, it.base.region.start, it.base.length, split))
            row += it.n
        longest = max(length for host in pieces.values() for _, _, _, length in host)
        return Plan(
            {slab: self._writes(w, row) for slab, w in writes.items()},
            {key: self._pieces(host) for key, host in pieces.items()},
            max(it.n for it in items),
            1 << max(8, (longest - 1).bit_length()),
        )

    def _writes(self, writes: list[tuple[torch.Tensor, torch.Tensor]], n_rows: int):
        rows = torch.cat([r for r, _ in writes])
        slots = torch.cat([s for _, s in writes]).to(self.device)
        everything = len(rows) == n_rows  # then rows are 0..T-1 in order: no gather needed
        return (None if everything else rows.to(self.device)), slots

    def _pieces(self, host: list[tuple[int, int, int, int]]) -> Pieces:
        rows = torch.cat([torch.arange(r0, r0 + n) for r0, n, _, _ in host])
        cu_q = torch.tensor([0, *accumulate(n for _, n, _, _ in host)], dtype=torch.int32)
        starts = torch.tensor([s for _, _, s, _ in host] + [0], dtype=torch.int32)
        lengths = torch.tensor([k for _, _, _, k in host], dtype=torch.int32)
        empty = torch.cat([torch.full((n,), k == 0) for _, n, _, k in host])
        dev = self.device
        return Pieces(rows.to(dev), cu_q.to(dev), starts.to(dev), lengths.to(dev), empty.to(dev), host)

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Run `embeds` (T, D) at `positions` (3, T) as `plan` says; writes their K/V into the pool
        and returns the final-norm hidden states (T, D)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.mrope_section, self.dtype)
        x = embeds.to(self.dtype)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, _rms_norm(layer.input_layernorm, x), cos, sin, plan)
            x = x + layer.mlp(_rms_norm(layer.post_attention_layernorm, x))
        return _rms_norm(self.norm, x)

    def _attention(self, i: int, layer, h: torch.Tensor, cos, sin, plan: Plan) -> torch.Tensor:
        attn = layer.self_attn
        n = h.shape[0]
        q = apply_rope(attn.q_proj(h).view(n, self.n_heads, self.head_dim).transpose(0, 1), cos, sin)
        k = apply_rope(attn.k_proj(h).view(n, self.n_kv_heads, self.head_dim).transpose(0, 1), cos, sin)
        v = attn.v_proj(h).view(n, self.n_kv_heads, self.head_dim).transpose(0, 1)
        for slab, (rows, slots) in plan.writes.items():
            kv = self.pool.slabs[slab][i]
            kv[0].index_copy_(1, slots, k if rows is None else k.index_select(1, rows))
            kv[1].index_copy_(1, slots, v if rows is None else v.index_select(1, rows))
        q = q.transpose(0, 1)  # (T, H, hd)
        parts = [
            self._piece_attention(q, self.pool.slabs[slab][i], p, causal, plan.max_q, plan.max_k)
            for (slab, causal), p in plan.pieces.items()
        ]
        out = _merge(n, parts)
        return attn.o_proj(out.reshape(n, self.n_heads * self.head_dim))

    def _piece_attention(self, q, kv, p: Pieces, causal: bool, max_q: int, max_k: int):
        """(out (R, H, hd), lse (R, H), rows (R,)) for every piece row."""
        if self.flash:
            out, lse = torch.ops.aten._flash_attention_forward(
                q.index_select(0, p.rows),
                kv[0].transpose(0, 1),  # (slots, kv_heads, hd): a strided view, read in place
                kv[1].transpose(0, 1),
                p.cu_q,
                p.starts,
                max_q,
                max_k,
                0.0,
                causal,
                False,
                scale=self.head_dim**-0.5,
                seqused_k=p.lengths,
            )[:2]
            lse = lse.transpose(0, 1)  # (H, R) -> (R, H)
            empty = p.empty_rows
            return out.masked_fill(empty[:, None, None], 0.0), lse.masked_fill(empty[:, None], -math.inf), p.rows
        outs, lses = [], []
        for r0, n, start, length in p.host:
            o, lse = self._cpu_attention(q[r0 : r0 + n], kv[:, :, start : start + length], causal)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses), p.rows

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


def _split(row: int, n: int, start: int, length: int, split: int) -> list[tuple[int, int, int, int]]:
    """A base's key range as `split` pieces for the same query rows (split-KV); empty pieces stay,
    so a batch's structure (and its CUDA graph) does not depend on the lengths."""
    if split == 1:
        return [(row, n, start, length)]
    step = max(math.ceil(length / split), 1)
    return [(row, n, start + s * step, max(0, min(step, length - s * step))) for s in range(split)]


def split_for(n_items: int, base_tokens: int, heads: int, n_sm: int = 132) -> int:
    """Split-KV factor: flash attention runs one block per (piece, head) for the few query rows of
    a question, so a handful of questions over a long cache needs its bases cut into pieces to
    keep every SM busy (twice over); with many questions one piece each already does."""
    if base_tokens < SPLIT_KV_MIN_TOKENS:
        return 1
    return max(1, min(16, (2 * n_sm) // max(1, n_items * heads)))


def _merge(n_rows: int, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax over the union of every piece a row read, from each piece's output and log-sum-exp."""
    outs = torch.cat([o for o, _, _ in parts]).float()
    lses = torch.cat([lse for _, lse, _ in parts])  # (R, H)
    rows = torch.cat([r for _, _, r in parts])
    heads = lses.shape[1]
    peak = torch.full((n_rows, heads), -math.inf, device=lses.device).scatter_reduce(
        0, rows[:, None].expand(-1, heads), lses, "amax"
    )
    weight = torch.exp(lses - peak.index_select(0, rows))  # 0 for empty pieces
    total = torch.zeros(n_rows, heads, device=lses.device).index_add_(0, rows, weight)
    out = torch.zeros(n_rows, heads, outs.shape[-1], device=outs.device).index_add_(0, rows, outs * weight[..., None])
    return (out / total[..., None]).to(parts[0][0].dtype)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """Qwen2.5-VL's RMSNorm (fp32 statistics, weight applied in the model dtype) in one fused op."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


class DecodeGraphs:
    """Decode steps (one token per item) replayed from CUDA graphs, one per batch-size bucket and
    split: eagerly a step is thousands of small kernel launches from Python, which is what bounds
    decode speed. A batch is padded to its bucket with rows that read and write a 1-token dummy
    region; the plan's indices are copied into the graph's own buffers before each replay."""

    BUCKETS = (1, 2, 4, 8, 16, 32, 64)

    def __init__(self, lm: LanguageModel):
        self.lm = lm
        self.dummy = lm.pool.alloc(1)
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def logits(self, tokens: list[int], positions: torch.Tensor, items: list[Item], split: int) -> torch.Tensor:
        n = len(items)
        bucket = next((b for b in self.BUCKETS if b >= n), None)
        if bucket is None:
            raise ValueError(f"{n} decode rows: more than the largest bucket {self.BUCKETS[-1]}")
        pad = bucket - n
        items = items + [Item(1, self.dummy, 0, base=KVView(self.dummy, 1))] * pad
        tokens = tokens + [0] * pad
        positions = torch.cat([positions, positions[:, -1:].expand(3, pad)], dim=1) if pad else positions
        plan = self.lm.plan(items, split)
        if plan.single_slab is None:  # spread over slabs: rare, and its shapes vary, so eager
            return self.lm.logits(self.lm.forward(self.lm.embed(tokens), positions, plan))[:n]
        key = (bucket, split, plan.single_slab, plan.max_k)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _Graph(self.lm, plan, bucket, self.mempool)
        return graph.replay(tokens, positions, plan)[:n]


class _Graph:
    def __init__(self, lm: LanguageModel, plan: Plan, bucket: int, mempool):
        self.lm, self.plan = lm, plan  # the plan's tensors are the graph's index buffers
        dev = lm.device
        self.tokens = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.positions = torch.zeros(3, bucket, dtype=torch.long, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step()  # warm-up outside the graph (allocations, kernel selection)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool, capture_error_mode="thread_local"):
            self.out = self._step()

    def _step(self) -> torch.Tensor:
        return self.lm.logits(self.lm.forward(self.lm.embed(self.tokens), self.positions, self.plan))

    def replay(self, tokens: list[int], positions: torch.Tensor, plan: Plan) -> torch.Tensor:
        self.tokens.copy_(torch.tensor(tokens), non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        for slab, (_, slots) in plan.writes.items():
            self.plan.writes[slab][1].copy_(slots, non_blocking=True)
        for key, pieces in plan.pieces.items():
            mine = self.plan.pieces[key]
            for name in ("rows", "cu_q", "starts", "lengths", "empty_rows"):
                getattr(mine, name).copy_(getattr(pieces, name), non_blocking=True)
        self.graph.replay()
        return self.out
