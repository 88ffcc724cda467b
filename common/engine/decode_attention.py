"""Attention of decode rows (one query token each) over key ranges of the pool, as a Triton kernel.

Flash attention's decode path swaps each row's query heads into rows itself (three small copies a
layer), splits the keys once more and combines (two kernels); at 100K cached tokens it read the
cache at 2.65 TB/s of the H200's 4.8. Here one program reads one piece's key range for one KV
head, once, for every query head that shares it (GQA), straight from the pool's (kv_heads, slots,
hd) layout, and writes the piece's output and log-sum-exp: the plan's pieces are already the
split-KV. `combine` merges a row's pieces in one kernel where lm.py's compiled merge of many
stacked copies took two (a reduction for the peak, one for the weighted sum), a kernel a layer
fewer in every decode step: beside an encode step each kernel waits for an SM.

The kernel is only used where Triton and a GPU are; lm.py's CPU path (exact, fp32) is the oracle
it is tested against (tests/test_gpu.py).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys a loop iteration reads: 16 KB of K and 16 KB of V per KV head
NUM_STAGES = 3  # loads in flight per program (Hopper's shared memory holds them)
NUM_WARPS = 4
LOG2_E = 1.4426950408889634


@triton.jit
def _piece_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    rows_ptr,
    starts_ptr,
    lengths_ptr,
    out_ptr,
    lse_ptr,
    stride_q_row,
    stride_q_head,
    stride_k_head,
    stride_k_slot,
    stride_v_head,
    stride_v_slot,
    stride_o_row,
    stride_o_head,
    stride_l_row,
    scale_log2,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    piece = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + piece)
    start = tl.load(starts_ptr + piece).to(tl.int64)
    length = tl.load(lengths_ptr + piece)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    in_group = offs_g < GROUP
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + offs_d[None, :], mask=in_group[:, None], other=0.0
    )
    k_base = k_ptr + kv_head * stride_k_head + start * stride_k_slot
    v_base = v_ptr + kv_head * stride_v_head + start * stride_v_slot
    peak = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in tl.range(0, length, BLOCK_N):
        keys = n0 + offs_n
        valid = keys < length
        k = tl.load(k_base + keys[:, None] * stride_k_slot + offs_d[None, :], mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # base-2 exponents: exp2 is one instruction
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(scores, 1))
        rescale = tl.exp2(peak - new_peak)
        p = tl.exp2(scores - new_peak[:, None])
        total = total * rescale + tl.sum(p, 1)
        v = tl.load(v_base + keys[:, None] * stride_v_slot + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        peak = new_peak
    seen = total > 0.0  # an empty piece (a split past a short base's end) adds nothing to the merge
    out = acc / tl.where(seen, total, 1.0)[:, None]
    lse_log2 = peak + tl.log2(tl.where(seen, total, 1.0))
    lse = tl.where(seen, lse_log2 * 0.6931471805599453, float("-inf"))  # times ln 2: back to natural logs
    tl.store(
        out_ptr + piece * stride_o_row + heads[:, None] * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=in_group[:, None],
    )
    tl.store(lse_ptr + piece * stride_l_row + heads, lse, mask=in_group)


def piece_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row per piece: q (T, H, hd), one slab layer's kv (2, kv_heads, slots, hd), each
    piece's query row, first slot and key count -> out (P, H, hd) and lse (P, H) in fp32, -inf for
    a piece with no keys."""
    n_pieces, heads, head_dim = rows.shape[0], q.shape[1], q.shape[2]
    k, v = kv[0], kv[1]
    if k.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("a head's values must be contiguous")
    group = heads // k.shape[0]
    out = torch.empty(n_pieces, heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n_pieces, heads, dtype=torch.float32, device=q.device)
    # Triton launches on the current device, and a worker may serve cuda:1
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _piece_kernel[(n_pieces, k.shape[0])](
            q,
            k,
            v,
            rows,
            starts,
            lengths,
            out,
            lse,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            scale * LOG2_E,
            GROUP=group,
            BLOCK_G=max(16, 1 << math.ceil(math.log2(group))),  # tl.dot takes at least 16 rows
            HEAD_DIM=head_dim,
            BLOCK_N=BLOCK_N,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return out, lse


COMBINE_MAX_BLOCK = 128  # pieces a loop iteration of the combine reads at most (a row's are 2-65)


@triton.jit
def _combine_kernel(
    out_ptr,
    lse_ptr,
    dest_ptr,
    n_rows,
    copies,
    stride_o_row,
    stride_o_head,
    stride_l_row,
    stride_d_row,
    stride_d_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, HEAD_DIM)
    peak = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for c0 in tl.range(0, copies, BLOCK_C):  # pass 1: the largest lse, element-wise over blocks
        c = c0 + offs_c
        lse = tl.load(lse_ptr + (c * n_rows + row) * stride_l_row + head, mask=c < copies, other=float("-inf"))
        peak = tl.maximum(peak, lse)
    top = tl.max(peak, 0)
    total = tl.zeros([BLOCK_C], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for c0 in tl.range(0, copies, BLOCK_C):  # pass 2: weights (0 for empty pieces) and their sum
        c = c0 + offs_c
        pieces = c * n_rows + row
        lse = tl.load(lse_ptr + pieces * stride_l_row + head, mask=c < copies, other=float("-inf"))
        weight = tl.exp(lse - top)
        out = tl.load(
            out_ptr + pieces[:, None] * stride_o_row + head * stride_o_head + offs_d[None, :],
            mask=(c < copies)[:, None],
            other=0.0,
        )
        total += weight
        acc += tl.sum(out.to(tl.float32) * weight[:, None], 0)
    merged = acc / tl.sum(total, 0)
    tl.store(dest_ptr + row * stride_d_row + head * stride_d_head + offs_d, merged.to(dest_ptr.dtype.element_ty))


def combine(out: torch.Tensor, lse: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Pieces stacked as whole copies of rows 0..n_rows-1 in order -- out (copies * n_rows, H, hd)
    and lse (copies * n_rows, H) from `piece_attention` -- merged into each row's attention over
    the union of its pieces' keys (n_rows, H, hd). Every row needs a piece with keys (its own)."""
    heads, head_dim, copies = out.shape[1], out.shape[2], out.shape[0] // n_rows
    if out.stride(2) != 1:
        raise ValueError("a head's values must be contiguous")
    dest = torch.empty(n_rows, heads, head_dim, dtype=out.dtype, device=out.device)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        _combine_kernel[(n_rows, heads)](
            out,
            lse,
            dest,
            n_rows,
            copies,
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            dest.stride(0),
            dest.stride(1),
            HEAD_DIM=head_dim,
            # every piece in one iteration where they fit (a program per row and head: few programs,
            # so a serial loop over blocks was the kernel's time); a power of two from 16, so at
            # most four variants compile
            BLOCK_C=min(COMBINE_MAX_BLOCK, max(16, 1 << (copies - 1).bit_length())),
            num_warps=4,
        )
    return dest
