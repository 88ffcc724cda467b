"""Our own forward pass of Qwen2.5-VL's language model, over KV storage we own.

transformers' modules supply the weights and the per-layer maths (norms, projections, MLP);
this file owns the cache and the attention, because the cache is the product: a stream's
KV lives in one preallocated tensor (an "arena") that chunks are written into in place, and
a question attends to a snapshot of that arena plus its own scratch space without copying
the snapshot. Positions are always explicit (see positions.py), so nothing here depends on
how transformers' generate() or Cache classes infer them in a given release.

KV layout: (layers, 2, kv_heads, capacity, head_dim); [:, 0] keys (stored rotated), [:, 1] values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from common.engine.model import LoadedModel
from common.engine.positions import apply_rope, rope_cos_sin


@dataclass(frozen=True)
class KVView:
    """The first `length` tokens of a KV tensor. Writers only ever write past every view's
    length, so a view is an immutable snapshot for as long as someone holds it."""

    kv: torch.Tensor
    length: int

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[i, 0, :, : self.length], self.kv[i, 1, :, : self.length]


class LanguageModel:
    def __init__(self, loaded: LoadedModel):
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

    def new_kv(self, capacity: int, zeroed: bool = False) -> torch.Tensor:
        """Zeroed where masked-out slots are read (0 x uninitialised NaN would still be NaN)."""
        shape = (self.n_layers, 2, self.n_kv_heads, capacity, self.head_dim)
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.embed_tokens(torch.tensor(ids, device=self.device))

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        start: int | torch.Tensor,
        base: KVView | None = None,
    ) -> torch.Tensor:
        """Run `embeds` (L, D) at `positions` (3, L); write their K/V into kv[..., start:start+L]
        and attend to kv[..., :start+L] causally, after all of `base` when given.
        Returns the final-norm hidden states (L, D).

        `start` may be a one-element tensor on the device for a single token over a base: every
        shape is then fixed whatever the position, so the step can be captured as a CUDA graph."""
        n_new = embeds.shape[0]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.mrope_section, self.dtype)
        if isinstance(start, torch.Tensor):
            if n_new != 1 or base is None:
                raise ValueError("a device-side start is for one token over a base")
            visible = torch.arange(kv.shape[3], device=self.device) <= start  # this token and the ones before
            own_mask = visible.expand(self.n_heads // self.n_kv_heads, -1)
        else:
            if start + n_new > kv.shape[3]:
                raise ValueError(f"KV capacity {kv.shape[3]} too small for {start + n_new} tokens")
            # A single new token sees every key: only multi-token steps need the causal mask.
            own_mask = self._causal_mask(n_new, start) if base is not None and n_new > 1 else None
        x = embeds.to(self.dtype)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, _rms_norm(layer.input_layernorm, x), cos, sin, kv, start, base, own_mask)
            x = x + layer.mlp(_rms_norm(layer.post_attention_layernorm, x))
        return _rms_norm(self.norm, x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _attention(self, i: int, layer, h: torch.Tensor, cos, sin, kv, start, base, own_mask) -> torch.Tensor:
        attn = layer.self_attn
        n_new = h.shape[0]
        q = attn.q_proj(h).view(n_new, self.n_heads, self.head_dim).transpose(0, 1)
        k = attn.k_proj(h).view(n_new, self.n_kv_heads, self.head_dim).transpose(0, 1)
        v = attn.v_proj(h).view(n_new, self.n_kv_heads, self.head_dim).transpose(0, 1)
        k = apply_rope(k, cos, sin)
        q = apply_rope(q, cos, sin)
        if isinstance(start, torch.Tensor):  # fixed shapes: write at a device index, attend to all, masked
            kv[i, 0].index_copy_(1, start, k)
            kv[i, 1].index_copy_(1, start, v)
            own_k, own_v = kv[i, 0], kv[i, 1]
        else:
            end = start + n_new
            kv[i, 0, :, start:end] = k
            kv[i, 1, :, start:end] = v
            own_k, own_v = kv[i, 0, :, :end], kv[i, 1, :, :end]
        if base is None:
            out = self._sdpa(q, own_k, own_v, start)
        else:
            base_k, base_v = base.layer(i)
            out = self._two_piece(q, base_k, base_v, own_k, own_v, own_mask)
        return attn.o_proj(out.transpose(0, 1).reshape(n_new, self.n_heads * self.head_dim))

    def _grouped(self, q: torch.Tensor) -> torch.Tensor:
        """(H, L, hd) -> (kv_heads, rep*L, hd): GQA without repeating K/V in memory."""
        rep = self.n_heads // self.n_kv_heads
        return q.reshape(self.n_kv_heads, rep * q.shape[1], self.head_dim)

    def _ungrouped(self, out: torch.Tensor, n_new: int) -> torch.Tensor:
        return out.reshape(self.n_heads, n_new, self.head_dim)

    def _causal_mask(self, n_new: int, start: int) -> torch.Tensor:
        """(rep*L, start+L) bool: query r (absolute start+r) sees keys 0..start+r."""
        rows = torch.arange(n_new, device=self.device)[:, None] + start
        cols = torch.arange(start + n_new, device=self.device)[None, :]
        return (cols <= rows).repeat(self.n_heads // self.n_kv_heads, 1)

    def _sdpa(self, q, k, v, start: int) -> torch.Tensor:
        """Chunk prefill: lower-right causal alignment lets flash attention skip building a
        (L, start+L) mask; GQA is native, so the cached K/V are read in place."""
        n_new = q.shape[1]
        mask = causal_lower_right(n_new, start + n_new)
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=True
        )
        return out[0]

    def _two_piece(self, q, base_k, base_v, own_k, own_v, own_mask: torch.Tensor | None) -> torch.Tensor:
        """Softmax over [base | own] without concatenating K/V. The cached base (large) goes through
        flash attention in place, the question's own tokens (few) through a second small attention;
        the two partial results merge by their log-sum-exp, as flash-decoding does."""
        n_new = q.shape[1]
        scale = self.head_dim**-0.5
        qg = self._grouped(q)[:, None]
        out_b, lse_b = _attention_with_lse(qg, base_k[:, None], base_v[:, None], scale)
        if own_mask is None:
            out_o, lse_o = _attention_with_lse(qg, own_k[:, None], own_v[:, None], scale)
        else:
            s_own = ((qg @ own_k[:, None].transpose(-1, -2)).float() * scale).masked_fill(~own_mask, -torch.inf)
            lse_o = torch.logsumexp(s_own, dim=-1)
            out_o = torch.exp(s_own - lse_o[..., None]).to(self.dtype) @ own_v[:, None]
        # softmax over both pieces = out_b + (out_o - out_b) * share of the own piece
        share = torch.sigmoid(lse_o - lse_b)[..., None]
        out = torch.lerp(out_b.float(), out_o.float(), share).to(self.dtype)
        return self._ungrouped(out[:, 0], n_new)


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """Qwen2.5-VL's RMSNorm (fp32 statistics, weight applied in the model dtype) in one fused op."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _attention_with_lse(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, L, D) attention with no mask, returning the output and its log-sum-exp (B, H, L)."""
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
        return out, lse
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]).to(v.dtype) @ v), lse
