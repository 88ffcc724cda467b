"""Retrieval features (common/engine/features.py) against transformers' own forward (tiny-random,
fp32, CPU): a chunk's vector, computed from its keys in the cache by turning them back from their
positions, equals its pre-RoPE keys' mean taken one-shot; a question's vector equals its pre-RoPE
queries' mean; and the score of the two is ReKV's per-layer inner product as a cosine, averaged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.engine.features import feature_layers, question_vector, unrotate
from common.engine.grid import Grid, StreamSpec
from common.engine.model import load_model
from common.engine.positions import apply_rope, rope_cos_sin, video_positions
from common.engine.runtime import Runtime
from common.engine.stream_engine import StreamEngine
from tests.engine_helpers import append_chunk, make_frames
from tests.retrieval_oracle import chunk_means, question_means, score

GRID = Grid(56, 56)
FPS, CHUNK = 2.0, 4


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def unit_layers(means: np.ndarray) -> np.ndarray:
    """(layers, kv_heads, hd) -> each layer flattened at unit length, concatenated."""
    flat = means.reshape(means.shape[0], -1)
    return (flat / np.linalg.norm(flat, axis=1, keepdims=True)).ravel()


def test_feature_layers_sit_in_the_middle_of_the_stack():
    assert feature_layers(36) == (13, 18, 22, 27)
    assert feature_layers(2) == (0, 1)
    assert feature_layers(1) == (0,)


def test_unrotate_inverts_the_rotary_embedding(rt):
    x = torch.randn(2, 24, rt.lm.head_dim)
    pos = video_positions(7, 3, 6, 2, 2, rt.loaded.temporal_interval(2.0))
    cos, sin = rope_cos_sin(pos, rt.lm.inv_freq, rt.lm.mrope_section, torch.float32)
    torch.testing.assert_close(unrotate(apply_rope(x, cos, sin), pos, rt), x, atol=1e-5, rtol=1e-5)


def test_chunk_and_question_vectors_and_scores_equal_the_one_shot_oracle(rt):
    frames = make_frames(4 * CHUNK, GRID, seed=3)
    got: list[tuple[tuple[int, int], np.ndarray]] = []
    engine = StreamEngine(
        rt, StreamSpec("cam", FPS, GRID, CHUNK), on_features=lambda seg, v: got.append((seg.frame_seqs, v.numpy()))
    )
    for i in range(0, len(frames), CHUNK):
        append_chunk(engine, frames, i, CHUNK)
    layers = engine.feature_layers
    assert [seqs for seqs, _ in got] == [(0, 3), (4, 7), (8, 11), (12, 15)]
    assert all(v.dtype == np.float16 for _, v in got), "published compactly"
    chunks = chunk_means(rt, frames, GRID, FPS, CHUNK, layers)
    for (_, v), means in zip(got, chunks, strict=True):
        np.testing.assert_allclose(v.astype(np.float32), unit_layers(means), atol=2e-3)

    for question in ("Is there a red van?", "Who is at the gate?"):
        q = question_vector(rt, question, layers)
        means = question_means(rt, question, layers)
        kv_heads = rt.lm.n_kv_heads
        np.testing.assert_allclose(
            q, unit_layers(means.reshape(len(layers), kv_heads, -1, means.shape[-1]).sum(2)), atol=1e-5
        )
        engine_scores = [float(q @ v.astype(np.float32)) / len(layers) for _, v in got]
        oracle_scores = [score(means, m) for m in chunks]
        np.testing.assert_allclose(engine_scores, oracle_scores, atol=2e-3)
        assert np.argsort(engine_scores).tolist() == np.argsort(oracle_scores).tolist()
        assert len(set(np.round(oracle_scores, 4))) == len(chunks), "random weights still tell chunks apart"


def test_a_question_vector_of_early_layers_stops_there_and_equals_the_oracle(rt, monkeypatch):
    """The question's forward stops once the last wanted layer's queries are seen (the layers
    after it feed only logits): at layer 0 of the tiny model's 2, layer 1 never runs, and the
    vector is the one-shot oracle's."""
    ran: list[int] = []
    attention = rt.lm._attention
    monkeypatch.setattr(rt.lm, "_attention", lambda i, *a: ran.append(i) or attention(i, *a))
    q = question_vector(rt, "Is there a red van?", (0,))
    assert ran == [], "layer 0's attention is not needed for its queries, nor anything after"
    means = question_means(rt, "Is there a red van?", (0,))
    kv_heads = rt.lm.n_kv_heads
    np.testing.assert_allclose(q, unit_layers(means.reshape(1, kv_heads, -1, means.shape[-1]).sum(2)), atol=1e-5)
