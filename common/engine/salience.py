"""How much a chunk differs from the one before it: what salient-chunk eviction keeps (eviction.py).

A chunk is summarised by the mean of its vision embeddings; its salience is the cosine distance
between its summary and the previous chunk's: ~0 through a static stretch, large at a scene change.
"""

from __future__ import annotations

import torch


def mean_embedding(embeds: torch.Tensor) -> torch.Tensor:
    """A chunk's summary: the mean of its vision embeddings (L, D), in fp32."""
    return embeds.float().mean(dim=0)


def salience(previous_mean: torch.Tensor | None, mean: torch.Tensor) -> float:
    """Cosine distance between a chunk's summary and the previous chunk's; 0 without a previous one."""
    if previous_mean is None:
        return 0.0
    return float(1.0 - torch.nn.functional.cosine_similarity(previous_mean, mean, dim=0))
