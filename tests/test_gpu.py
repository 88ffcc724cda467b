"""GPU-only checks (skipped on CPU machines; run on the device with `pytest tests/test_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from common.engine.lm import _attention_with_lse

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


def test_decode_as_cuda_graph_equals_the_same_steps_launched_eagerly(monkeypatch):
    import numpy as np

    from common.engine import answer
    from common.engine.grid import Grid, StreamSpec
    from common.engine.model import load_model
    from common.engine.runtime import Runtime
    from common.engine.stream import StreamEngine

    rt = Runtime(load_model("tiny-random", device="cuda"))
    engine = StreamEngine(rt, StreamSpec("cam", 2.0, Grid(56, 84), 4))
    rng = np.random.default_rng(0)
    for _ in range(3):
        engine.append([rng.integers(0, 256, (56, 84, 3), dtype=np.uint8) for _ in range(4)])
    params = answer.GenerationParams(max_tokens=48)
    graphed = answer.ask(rt, engine.head, "What happens?", params)
    monkeypatch.setattr(answer, "CUDA_GRAPHS", False)
    eager = answer.ask(rt, engine.head, "What happens?", params)
    assert graphed.token_ids == eager.token_ids and len(graphed.token_ids) > 1
