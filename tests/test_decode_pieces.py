"""How lm.py uses the GPU's attention kernels, checked on the CPU with exact implementations of
their contracts in the kernels' place: the decode-row kernels (decode_attention.piece_attention:
one query row a piece, its first slot and key count; out and lse per piece, lse -inf for a piece
with no keys; decode_attention.combine: pieces stacked as copies of the rows merged per row) and
cuDNN's attention that chunks read their caches' bodies with (lm.cudnn_body_attention). The
kernels themselves are held to the exact ones on a GPU (tests/test_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch

from common.engine.answer import ask
from common.engine.grid import Grid
from common.engine.model import load_model
from common.engine.offline import offline_answer
from common.engine.params import GenerationParams
from common.engine.runtime import Runtime
from tests.engine_helpers import QUESTION, exact_attention, items_over_one_cache, make_frames, stream


def exact_piece_attention(q, kv, rows, starts, lengths, scale):
    """The kernel's contract in fp32: q (T, H, hd), kv (2, kv_heads, slots, hd), per piece its
    query row, first slot and key count -> out (P, H, hd), lse (P, H)."""
    heads, group = q.shape[1], q.shape[1] // kv.shape[1]
    out = torch.zeros(rows.shape[0], heads, q.shape[2], dtype=q.dtype)
    lse = torch.full((rows.shape[0], heads), -math.inf)
    for p, (row, start, n) in enumerate(zip(rows.tolist(), starts.tolist(), lengths.tolist(), strict=False)):
        if n:
            k = kv[0, :, start : start + n].float().repeat_interleave(group, 0)  # (H, n, hd)
            v = kv[1, :, start : start + n].float().repeat_interleave(group, 0)
            scores = (k @ q[row].float()[:, :, None])[..., 0] * scale  # (H, n)
            lse[p] = torch.logsumexp(scores, -1)
            out[p] = (torch.softmax(scores, -1)[:, None, :] @ v)[:, 0].to(q.dtype)
    return out, lse


def exact_combine(out, lse, n_rows):
    """The combine's contract in fp32: out (copies * n_rows, H, hd) and lse (copies * n_rows, H)
    of pieces stacked as whole copies of the rows -> each row's attention over all its pieces."""
    copies = out.shape[0] // n_rows
    weights = torch.softmax(lse.view(copies, n_rows, -1), 0)  # an empty piece (lse -inf) weighs 0
    return (out.view(copies, n_rows, *out.shape[1:]).float() * weights[..., None]).sum(0).to(out.dtype)


@pytest.fixture
def rt():
    rt = Runtime(load_model("tiny-random"), pool_tokens=1 << 16)
    rt.lm.decode_kernel, rt.lm.decode_combine = exact_piece_attention, exact_combine
    return rt


def test_a_streamed_answer_decoded_through_the_kernels_contract_equals_offline(rt):
    grid = Grid(56, 84)
    frames = make_frames(8, grid, seed=3)
    engine = stream(rt, frames, grid, 2, 4)
    streamed = ask(rt, engine.head, QUESTION, GenerationParams(max_tokens=12))
    offline = offline_answer(rt, frames, grid, 2, QUESTION, max_tokens=12)
    assert streamed.token_ids == offline.token_ids and len(streamed.token_ids) > 1


@pytest.mark.parametrize("split", [1, 4, 64])
def test_decode_rows_split_into_pieces_equal_the_cpu_path(rt, split):
    """Decode rows over bases cut into up to 64 pieces (empty ones past a short base's end, a
    base in two extents): the forward through the kernel's contract equals the CPU path's."""
    lm = rt.lm
    torch.manual_seed(0)
    bases = [((0, 3_000),), ((0, 7),), ((0, 1_000), (1_500, 900))]
    items = items_over_one_cache(rt, 3_000, [(1, at, b) for at, b in zip((3, 0, 9), bases, strict=True)])
    embeds = torch.randn(len(items), lm.embed_tokens.embedding_dim) * 0.02
    positions = torch.tensor([5_000, 30, 4_000]).expand(3, -1)
    plan = lm.plan(items, split)
    through_kernel = lm.forward(embeds, positions, plan)
    with exact_attention(lm):
        assert torch.allclose(through_kernel, lm.forward(embeds, positions, plan), atol=1e-5)


def exact_cudnn_attention(q, k, v, scale):
    """cuDNN's contract in fp32: q (B, H, S, hd), k and v (B, H, L, hd) -> out, lse (B, H, S)."""
    scores = q @ k.transpose(-1, -2) * scale
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def test_chunks_read_their_bodies_in_pieces_as_exact_attention_item_by_item(monkeypatch):
    """Items of different row counts (chunks of different grids) and body lengths in one call, each
    body cut into pieces read in place from one pool layer: merged by log-sum-exp, every row equals
    exact attention over its own item's body."""
    from common.engine import lm as lm_module

    monkeypatch.setattr(lm_module, "_cudnn_attention", exact_cudnn_attention)
    torch.manual_seed(0)
    heads, kv_heads, hd, splits = 4, 2, 16, 4
    spans = ((500, 256, 8), (1200, 512, 8), (3000, 256, 4), (100, 128, 8), (2000, 256, 8))  # (slot, tokens, rows)
    bodies = tuple(lm_module.BodyItem(*span) for span in spans)
    q = torch.randn(sum(n for _, _, n in bodies), heads, hd)
    layer = torch.randn(2, kv_heads, 4000, hd)
    out, lse = lm_module.cudnn_body_attention(q, layer, bodies, splits, hd**-0.5)
    assert out.shape == (splits * q.shape[0], heads, hd) and lse.shape == (splits * q.shape[0], heads)
    merged = lm_module._merge_stacked(q.shape[0], [(out, lse, None)])
    total_lse = torch.logsumexp(lse.view(splits, -1, heads), 0)
    r0 = 0
    for start, length, n in bodies:
        qi = q[r0 : r0 + n].transpose(0, 1)  # (H, n, hd)
        k, v = (t[:, start : start + length].repeat_interleave(heads // kv_heads, 0) for t in layer)
        want, want_lse = exact_cudnn_attention(qi, k, v, hd**-0.5)
        torch.testing.assert_close(merged[r0 : r0 + n], want.transpose(0, 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(total_lse[r0 : r0 + n], want_lse.transpose(0, 1), atol=1e-5, rtol=1e-5)
        r0 += n


def test_a_base_is_cut_into_equal_pieces_that_cover_it_in_order():
    """Split-KV: exactly `split` pieces of the same query rows, of ceil(length / split) keys each
    but the last non-empty one, back to back over the base, then empty ones (a batch's structure
    does not depend on its lengths)."""
    from common.engine.lm import _split

    for length in (0, 1, 63, 64, 65, 1000, 32557):
        for split in (1, 2, 3, 8, 64):
            pieces = _split(5, 2, 100, length, split)
            assert len(pieces) == split and {(row, n) for row, n, _, _ in pieces} == {(5, 2)}
            sizes = [k for _, _, _, k in pieces]
            filled = [k for k in sizes if k]
            assert sizes == filled + [0] * (split - len(filled)) and sum(sizes) == length
            assert all(k == -(-length // split) for k in filled[:-1])
            assert [start for _, _, start, k in pieces if k] == [100 + sum(filled[:i]) for i in range(len(filled))]
