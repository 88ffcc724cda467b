"""GPU-only checks (skipped on CPU machines; run on the device with `pytest tests/test_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from common.lm import _attention_with_lse

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("n", [45, 4096, 99_885])
def test_flash_attention_log_sum_exp_matches_maths_on_a_strided_cache_view(n):
    """The question path merges flash attention over the cache with its own tokens by log-sum-exp:
    both the output and the LSE of the CUDA kernel must be what the maths says, on a view of an
    arena (odd length, strided), in bf16."""
    torch.manual_seed(0)
    q = torch.randn(2, 1, 8 * 31, 128, device="cuda", dtype=torch.bfloat16)
    arena = torch.randn(2, 2, n + 7, 128, device="cuda", dtype=torch.bfloat16)
    k, v = arena[:, 0, :n][:, None], arena[:, 1, :n][:, None]
    out, lse = _attention_with_lse(q, k, v, 128**-0.5)
    scores = (q.float() @ k.float().transpose(-1, -2)) * 128**-0.5
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-3)
    assert torch.allclose(out.float(), torch.softmax(scores, -1) @ v.float(), atol=2e-2)
