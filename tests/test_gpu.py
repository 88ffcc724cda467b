"""GPU-only checks (skipped on CPU machines; run on the device with `pytest tests/test_gpu.py`).

The CPU oracles prove the batching logic in fp32; these prove that the CUDA paths (varlen flash
attention over pool regions, split-KV, decode replayed from CUDA graphs) compute the same thing.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 logits of the same step computed in other shapes (a padded batch, a graph, eager): the
    matrix products pick other kernels, so each logit may be off by a rounding or two at the
    largest logit's scale (2 ulps: 0.031 for logits in [2, 4)); the greedy tokens are compared exactly."""
    scale = want.abs().max().item()
    tol = 2 * 2.0 ** (math.floor(math.log2(scale)) - 7)
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= tol, f"logits differ by {diff:.4f} (max |logit| {scale:.3f}, tolerance {tol:.4f})"


@pytest.fixture(scope="module")
def rt():
    from common.engine.model import load_model
    from common.engine.runtime import Runtime

    return Runtime(load_model("tiny-random", device="cuda", dtype="bfloat16"), pool_tokens=1 << 18)


def _assert_pieces_equal_exact(rt, lengths: list[int], split: int, atol: tuple[float, float]) -> None:
    """Items of `lengths` new tokens over bases of a 20K-token cache (two questions on one
    version, a short base, one in two extents padded with an empty piece to the others' count):
    every piece group of the plan as the GPU attends it against the exact CPU pieces (lse, out)."""
    from tests.engine_helpers import exact_attention, items_over_one_cache

    lm = rt.lm
    torch.manual_seed(0)
    bases = [((0, 20_000),), ((0, 12_345),), ((0, 7),), ((0, 7_000), (9_001, 5_000)), ((0, 12_345),)]
    ats = (10, 30, 0, 5, 63 - max(lengths))
    items = items_over_one_cache(rt, 20_000, list(zip(lengths, ats, bases, strict=False)))
    plan = lm.plan(items, split)
    q = torch.randn(sum(lengths), lm.n_heads, lm.head_dim, device="cuda", dtype=torch.bfloat16)
    for (slab, causal), pieces in plan.pieces.items():
        kv = rt.pool.slabs[slab][0]
        out, lse, _ = lm._piece_attention(q, kv, pieces, causal, plan.max_q)
        with exact_attention(lm):
            ref_out, ref_lse, _ = lm._piece_attention(q, kv, pieces, causal, plan.max_q)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        assert torch.allclose(lse[finite], ref_lse[finite], atol=atol[0])
        # both outputs rounded to bf16 from fp32: a rounding apart is 2^-7 of the value, past atol above 2
        torch.testing.assert_close(out.float(), ref_out.float(), atol=atol[1], rtol=2**-7)


@pytest.mark.parametrize("split", [1, 4])
def test_varlen_flash_pieces_equal_the_exact_cpu_pieces(rt, split):
    """Items of several tokens (flash): causal own pieces, split bases."""
    _assert_pieces_equal_exact(rt, [5, 1, 3, 2], split, atol=(1e-2, 2e-2))


@pytest.mark.parametrize("split", [1, 4, 16])
def test_decode_rows_through_the_triton_kernel_equal_the_exact_cpu_pieces(rt, split):
    """Decode rows (one token an item: lm's Triton kernel, not flash), splits that leave pieces empty."""
    assert rt.lm.decode_kernel is not None
    _assert_pieces_equal_exact(rt, [1, 1, 1, 1, 1], split, atol=(1e-3, 1e-2))


@pytest.mark.parametrize("copies", [2, 17, 65])
def test_the_triton_combine_of_stacked_decode_pieces_equals_the_exact_merge(copies):
    """Pieces stacked as copies of 8 rows (copy counts below, at and past a loop block), every
    row's last piece empty (lse -inf, as a split past a base's end) and lse spread over tens:
    the kernel's merge against the softmax over the copies in fp32."""
    from common.engine.decode_attention import combine
    from tests.test_decode_pieces import exact_combine

    torch.manual_seed(0)
    rows, heads, hd = 8, 16, 128
    out = torch.randn(copies * rows, heads, hd, device="cuda").to(torch.bfloat16)
    lse = torch.randn(copies * rows, heads, device="cuda") * 20
    lse[-rows:] = -math.inf
    merged = combine(out, lse, rows)
    torch.testing.assert_close(merged.float(), exact_combine(out, lse, rows).float(), atol=1e-2, rtol=2**-7)


def _engine(rt, name: str, grid, n_chunks: int, seed: int):
    from common.engine.grid import StreamSpec
    from common.engine.stream_engine import StreamEngine

    engine = StreamEngine(rt, StreamSpec(name, 2.0, grid, 4))
    rng = np.random.default_rng(seed)
    for _ in range(n_chunks):
        engine.append([rng.integers(0, 256, (grid.height, grid.width, 3), dtype=np.uint8) for _ in range(4)])
    return engine


def test_batched_graphed_decode_equals_one_at_a_time_eager(rt, monkeypatch):
    from common.engine import answer
    from common.engine.grid import Grid
    from common.engine.params import GenerationParams
    from common.engine.scheduler import Scheduler
    from common.engine.work import InlineExecutor

    engines = [_engine(rt, f"s{i}", g, n, i) for i, (g, n) in enumerate([(Grid(56, 84), 3), (Grid(84, 56), 5)])]
    params = GenerationParams(max_tokens=24)
    asks = [(e, q) for e in engines for q in ("What happens?", "Anything red?", "Count them.")]
    scheduler = Scheduler().start()
    rt.executor = scheduler
    batched: list = [None] * len(asks)
    threads = [
        threading.Thread(target=lambda i=i, e=e, q=q: batched.__setitem__(i, answer.ask(rt, e.head, q, params)))
        for i, (e, q) in enumerate(asks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    scheduler.stop()
    times = scheduler.decode_times  # the steps timed on the device (CUDA events), within launch-to-read
    assert 0 < times.device <= times.steps
    rt.executor = InlineExecutor()
    monkeypatch.setattr(answer, "CUDA_GRAPHS", False)
    for (e, q), got in zip(asks, batched, strict=True):
        alone = answer.ask(rt, e.head, q, params)
        assert got.token_ids[:8] == alone.token_ids[:8] and len(got.token_ids) > 1


def test_graphed_question_prefill_and_decode_equal_eager(rt, monkeypatch):
    """A lone question: its prefill padded to a length bucket and replayed from a graph, then its
    decode steps graphed, give the tokens and first logits of the same steps launched eagerly."""
    from common.engine import answer
    from common.engine.grid import Grid
    from common.engine.params import GenerationParams

    engine = _engine(rt, "lone", Grid(56, 56), 4, 7)
    params = GenerationParams(max_tokens=16)
    graphed = [answer.ask(rt, engine.head, q, params, keep_logits=True) for q in ("Why?", "What is on the left?")]
    assert rt.step_graphs is not None and any(len(key[0]) == 1 and key[0][0] > 1 for key in rt.step_graphs.graphs)
    monkeypatch.setattr(answer, "CUDA_GRAPHS", False)
    for q, got in zip(("Why?", "What is on the left?"), graphed, strict=True):
        eager = answer.ask(rt, engine.head, q, params, keep_logits=True)
        assert got.token_ids[:8] == eager.token_ids[:8]
        assert_logits_close(got.first_logits, eager.first_logits)


def test_a_question_joining_mid_decode_is_prefilled_from_its_own_graph(rt, monkeypatch):
    """A batch of decode steps plus a new question's prefill has no graph of its own: the decode
    steps and the prefill each replay theirs (nothing runs eagerly), and the late question's
    tokens and first logits are those it gets alone, launched eagerly."""
    from common.engine import answer
    from common.engine.grid import Grid
    from common.engine.params import GenerationParams

    engine = _engine(rt, "join", Grid(56, 56), 3, 11)
    params = GenerationParams(max_tokens=12)
    first = answer.Generation(rt, engine.head, "What happens?", params)
    answer.Generation.step_batch([first])  # its prefill, then a decode step
    answer.Generation.step_batch([first])
    late = answer.Generation(rt, engine.head, "Is anything red?", params, keep_logits=True)
    ungraphed = []
    run = rt.step_graphs.run
    monkeypatch.setattr(rt.step_graphs, "run", lambda *a: ungraphed.append(a) if (out := run(*a)) is None else out)
    while not (first.done and late.done):
        answer.Generation.step_batch([g for g in (first, late) if not g.done])
    assert ungraphed == []
    monkeypatch.setattr(answer, "CUDA_GRAPHS", False)
    alone = answer.ask(rt, engine.head, "Is anything red?", params, keep_logits=True)
    got = late.future.result()
    assert got.token_ids[:8] == alone.token_ids[:8]
    assert_logits_close(got.first_logits, alone.first_logits)


def test_questions_arriving_together_are_prefilled_from_one_graph(rt, monkeypatch):
    """Three questions of one length bucket on two streams, stepped together: their prefills are
    one replay (a batch of 4 with a dummy item, nothing eager), and each question gets the tokens
    and first logits it gets alone, launched eagerly."""
    from common.engine import answer
    from common.engine.grid import Grid
    from common.engine.params import GenerationParams

    engines = [_engine(rt, "together-a", Grid(56, 56), 3, 13), _engine(rt, "together-b", Grid(56, 84), 2, 17)]
    params = GenerationParams(max_tokens=12)
    questions = ["What is on the left?", "Is anything red here?", "What happens next in the scene?"]
    gens = [answer.Generation(rt, engines[i % 2].head, q, params, keep_logits=True) for i, q in enumerate(questions)]
    if rt.step_graphs is None:
        rt.step_graphs = answer.StepGraphs(rt.lm, on_capture=rt.on_graph_capture)
    calls: list[tuple[int, bool]] = []
    run = rt.step_graphs.run
    monkeypatch.setattr(
        rt.step_graphs, "run", lambda *a: calls.append((len(a[2]), (out := run(*a)) is not None)) or out
    )
    while not all(g.done for g in gens):
        answer.Generation.step_batch([g for g in gens if not g.done])
    assert calls[0] == (3, True) and all(graphed for _, graphed in calls)
    assert any(key[0] == (64,) * 4 for key in rt.step_graphs.graphs)
    monkeypatch.setattr(answer, "CUDA_GRAPHS", False)
    for i, (q, g) in enumerate(zip(questions, gens, strict=True)):
        alone = answer.ask(rt, engines[i % 2].head, q, params, keep_logits=True)
        got = g.future.result()
        assert got.token_ids[:8] == alone.token_ids[:8]
        assert_logits_close(got.first_logits, alone.first_logits)


def test_question_graphs_stay_the_same_while_caches_grow(rt, monkeypatch):
    """A graph's key ranges are bounded for caches up to GRAPH_BASE_TOKENS, not by the cache it
    first met: questions on a cache of 9K tokens and then of 17K (split-KV pieces past a power of
    two) replay the same graphs, and answer as the eager steps do. The stream has a budget, as
    serving streams do, so its cache stays in one extent (a base's pieces depend on its extents)."""
    from common.engine import answer
    from common.engine.eviction import EvictionPolicy
    from common.engine.grid import Grid, StreamSpec
    from common.engine.params import GenerationParams
    from common.engine.step_graphs import GRAPH_BASE_TOKENS
    from common.engine.stream_engine import StreamEngine

    grid = Grid(448, 448)
    policy = EvictionPolicy(max_cache_tokens=GRAPH_BASE_TOKENS)
    engine = StreamEngine(rt, StreamSpec("grow", 2.0, grid, 4), policy)
    params = GenerationParams(max_tokens=6)
    captured, answers = [], []
    for seq, patches in enumerate((36, 32)):  # 9.2K tokens, then 17.4K
        embeds = torch.randn(patches * grid.tokens_per_patch, rt.lm.embed_tokens.embedding_dim, device="cuda") * 0.02
        engine.append_embeddings(embeds, patches, (seq, seq), (0.0, 0.0))  # a segment's id is its first frame's
        assert len(engine.head.view.extents) == 1 and engine.head.stats.evictions == 0
        answers.append(answer.ask(rt, engine.head, "What is happening?", params, keep_logits=True))
        captured.append(set(rt.step_graphs.graphs))
    assert captured[0] and captured[1] == captured[0]
    monkeypatch.setattr(answer, "CUDA_GRAPHS", False)
    eager = answer.ask(rt, engine.head, "What is happening?", params, keep_logits=True)
    assert answers[1].token_ids[:4] == eager.token_ids[:4]
    assert_logits_close(answers[1].first_logits, eager.first_logits)


def test_a_decode_batch_replays_its_buckets_graph_whatever_its_size(rt, monkeypatch):
    """Split-KV follows the graph's padded shape, not the batch's: 5 questions decoding together
    over a long cache replay the graph that 8 captured (before, each size of 5 to 8 split the
    keys its own way and captured its own graph while serving), and answer as launched eagerly."""
    from common.engine import answer
    from common.engine.grid import Grid, StreamSpec
    from common.engine.params import GenerationParams
    from common.engine.stream_engine import StreamEngine

    grid = Grid(448, 448)
    engine = StreamEngine(rt, StreamSpec("buckets", 2.0, grid, 4))
    embeds = torch.randn(36 * grid.tokens_per_patch, rt.lm.embed_tokens.embedding_dim, device="cuda") * 0.02
    engine.append_embeddings(embeds, 36, (0, 0), (0.0, 0.0))  # 9.2K tokens: split-KV applies
    params = GenerationParams(max_tokens=4)

    def decode_together(n: int) -> list:
        gens = [answer.Generation(rt, engine.head, "What is happening?", params, keep_logits=True) for _ in range(n)]
        while not all(g.done for g in gens):
            answer.Generation.step_batch([g for g in gens if not g.done])
        return [g.future.result() for g in gens]

    decode_together(8)
    graphs = set(rt.step_graphs.graphs)
    got = decode_together(5)
    assert set(rt.step_graphs.graphs) == graphs
    monkeypatch.setattr(answer, "CUDA_GRAPHS", False)
    eager = answer.ask(rt, engine.head, "What is happening?", params, keep_logits=True)
    assert got[0].token_ids[:3] == eager.token_ids[:3]
    assert_logits_close(got[0].first_logits, eager.first_logits)


def test_after_the_warm_up_a_question_on_a_long_serving_cache_captures_nothing(rt, monkeypatch):
    """The warm-up's caches lie in one extent, as a budgeted serving stream's do, so a lone
    question's prefill and decode over a long serving cache replay graphs the warm-up captured
    (under the paged pool, unbudgeted warm-up caches in 2-3 extents had other pieces, so other keys),
    and so do longer questions arriving together."""
    from common.engine import answer
    from common.engine.eviction import EvictionPolicy
    from common.engine.grid import Grid, StreamSpec
    from common.engine.params import GenerationParams
    from common.engine.step_graphs import GRAPH_BASE_TOKENS
    from common.engine.stream_engine import StreamEngine
    from common.engine.warmup import _question_of, warm_up

    monkeypatch.setattr(rt.vision_tower, "graphs", True)
    warm_up(rt)
    warmed = set(rt.step_graphs.graphs)
    # the vision tower's graphs too (gpu_vision_graphs): every batch of 448² chunks big enough to be compiled
    assert all(((2, 32, 32),) * n in rt.vision_tower._graphs for n in range(2, 9))
    grid = Grid(448, 448)
    engine = StreamEngine(rt, StreamSpec("served", 2.0, grid, 4), EvictionPolicy(max_cache_tokens=GRAPH_BASE_TOKENS))
    patches = 48  # 12K tokens: past SPLIT_KV_MIN_TOKENS like the warm-up's long caches, another length
    embeds = torch.randn(patches * grid.tokens_per_patch, rt.lm.embed_tokens.embedding_dim, device="cuda") * 0.02
    engine.append_embeddings(embeds, patches, (0, 0), (0.0, 0.0))
    assert len(engine.head.view.extents) == 1
    answer.ask(rt, engine.head, "What is happening?", GenerationParams(max_tokens=4))
    assert set(rt.step_graphs.graphs) == warmed
    question = _question_of(rt, 60)  # the 64-token bucket
    gens = [answer.Generation(rt, engine.head, question, GenerationParams(max_tokens=3)) for _ in range(6)]
    while not all(g.done for g in gens):  # six arriving together: the prefill graph of 8 x 64 tokens
        answer.Generation.step_batch([g for g in gens if not g.done])
    assert set(rt.step_graphs.graphs) == warmed


def test_questions_decoded_beside_an_encode_step_equal_alone(rt, monkeypatch):
    """On the GPU the decode steps launched between an encode step's layers run on a
    high-priority CUDA stream, concurrently with it: same answer, same caches."""
    from tests.test_scheduler import answer_beside_encoding

    rt.step_graphs = None  # so the graphs are captured beside the encode step, and replayed after it
    answer_beside_encoding(rt, monkeypatch, atol=0.0)


def test_questions_decoded_beside_an_encode_step_that_leaves_them_sms_equal_alone(rt, monkeypatch):
    """`decode_sms` on the GPU: the encode step runs in a green context of fewer SMs (its kernels
    may split their work otherwise, so its caches are equal to encoding alone within bf16
    rounding, not bit for bit); the questions beside it answer exactly as alone."""
    from tests.test_scheduler import answer_beside_encoding

    rt.step_graphs = None
    answer_beside_encoding(rt, monkeypatch, atol=0.0, decode_sms=16, cache_atol=0.05)


def test_a_question_joining_during_an_encode_step_equals_alone(rt, monkeypatch):
    """`join_during_encode` on the GPU: a question arriving while an encode step is launched is
    prefilled on the high-priority CUDA stream beside it, reading a version the step does not write:
    same answer as alone, same chunk cache as encoding alone."""
    from tests.test_scheduler import answer_joining_during_encoding

    answer_joining_during_encoding(rt, monkeypatch, join=True, atol=0.0)


def test_frames_patchified_on_the_gpu_equal_the_cpu_pixels():
    """The normalising gather and the patch permutation give the same float32 bits on either device."""
    from common.engine.frames import frames_to_pixels, patchify, stack_frames
    from common.engine.grid import Grid

    grid = Grid(84, 112)
    frames = np.random.default_rng(3).integers(0, 256, (4, 84, 112, 3), dtype=np.uint8)
    cpu, thw = frames_to_pixels(frames, grid)
    gpu, gpu_thw = patchify(stack_frames(frames, grid, pin_memory=True).to("cuda", non_blocking=True))
    assert gpu_thw == thw and torch.equal(gpu.cpu(), cpu)


def test_segments_reach_the_store_as_the_pool_holds_them(rt):
    """The K/V copy to the host is asynchronous (page-locked, waited for in `finish`): what
    `on_segment` gets is what the pool holds, in that page-locked host memory (the segment writer
    takes it as it is, with no clone)."""
    from common.engine.grid import Grid, StreamSpec
    from common.engine.stream_engine import StreamEngine

    got = []
    engine = StreamEngine(rt, StreamSpec("store", 2.0, Grid(56, 56), 4), on_segment=lambda s, kv: got.append((s, kv)))
    rng = np.random.default_rng(5)
    engine.append([rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(4)])
    view = engine.head.view
    offset = 0
    for segment, kv in got:
        assert kv.device.type == "cpu" and kv.is_pinned()
        assert torch.equal(kv, view.kv[:, :, :, offset : offset + segment.tokens].cpu())
        offset += segment.tokens
    assert got[0][0].id == "prefix" and offset == engine.head.tokens


def test_exact_rebuild_in_pieces_beside_another_stream_equals_one_piece_alone(rt):
    """An exact eviction's rebuild, cut into pieces that ride in encode steps with another stream's
    chunks (flash over pool regions, bf16), against the rebuild as one piece run alone."""
    from common.engine.answer import ask
    from common.engine.eviction import EvictionPolicy
    from common.engine.grid import Grid, StreamSpec
    from common.engine.params import GenerationParams
    from common.engine.scheduler import Scheduler
    from common.engine.stream_engine import StreamEngine
    from common.engine.work import InlineExecutor

    grid = Grid(56, 56)  # 8 tokens per 4-frame chunk
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(4 * 24)]
    prefix = len(rt.prefix_ids())

    def run(piece: int) -> StreamEngine:
        policy = EvictionPolicy(prefix + 12 * 8, 0.5, sink_chunks=1, mode="exact", rebuild_piece_tokens=piece)
        engine = StreamEngine(rt, StreamSpec("exact", 2.0, grid, 4), policy)
        for i in range(0, len(frames), 4):
            engine.append(frames[i : i + 4], frame_seqs=list(range(i, i + 4)))
        return engine

    scheduler = Scheduler().start()
    rt.executor = scheduler
    other = threading.Thread(target=_engine, args=(rt, "other", Grid(84, 56), 12, 9))
    other.start()
    batched = run(piece=5)
    other.join(timeout=120)
    scheduler.stop()
    rt.executor = InlineExecutor()
    alone = run(piece=1 << 20)
    head, ref = batched.head, alone.head
    assert head.stats.evictions >= 2 and [p.segment.id for p in head.placements] == [
        p.segment.id for p in ref.placements
    ]
    n = head.tokens
    assert torch.allclose(head.view.kv[:, :, :, :n].float(), ref.view.kv[:, :, :, :n].float(), atol=5e-2)
    params = GenerationParams(max_tokens=12)
    got, want = (ask(rt, v, "What happens?", params) for v in (head, ref))
    assert got.token_ids[:8] == want.token_ids[:8]


def test_cudnn_body_attention_equals_exact_attention():
    """The cuDNN body kernel at random-3b's head layout (16 query heads on 2 KV heads, 128 wide),
    four items of different lengths read in place from one pool layer, each cut into pieces and
    merged, against exact fp32 attention item by item."""
    from common.engine import lm as lm_module

    if not lm_module._cudnn_attention_works(torch.device("cuda"), torch.bfloat16, 128):
        pytest.skip("cuDNN attention is not available here")
    torch.manual_seed(0)
    n, heads, kv_heads, hd = 64, 16, 2, 128
    spans = ((5000, 4096, n), (100, 8192, n), (20000, 4096, n), (12000, 8192, n))  # (first slot, tokens, rows)
    bodies = tuple(lm_module.BodyItem(*span) for span in spans)
    q = torch.randn(len(bodies) * n, heads, hd, device="cuda", dtype=torch.bfloat16)
    layer = torch.randn(2, kv_heads, 30000, hd, device="cuda", dtype=torch.bfloat16)
    splits = lm_module._body_splits(torch.device("cuda"), n, heads, kv_heads, lm_module.BodyPolicy())
    assert splits > 1  # a few rows over long bodies: cut into pieces to fill the GPU
    out, lse = lm_module.cudnn_body_attention(q, layer, bodies, splits, hd**-0.5)
    assert out.shape[0] == lse.shape[0] == splits * q.shape[0]
    merged = lm_module._merge_stacked(q.shape[0], [(out, lse, None)])
    total_lse = torch.logsumexp(lse.view(splits, -1, heads), 0)
    for i, (start, length, _) in enumerate(bodies):
        qi = q[i * n : (i + 1) * n].float().transpose(0, 1)  # (H, n, hd)
        k, v = (t[:, start : start + length].float().repeat_interleave(heads // kv_heads, 0) for t in layer)
        scores = qi @ k.transpose(1, 2) * hd**-0.5
        ref_lse = torch.logsumexp(scores, -1)  # (H, n)
        ref = (torch.softmax(scores, -1) @ v).transpose(0, 1)
        assert torch.allclose(total_lse[i * n : (i + 1) * n], ref_lse.transpose(0, 1), atol=1e-2)
        assert torch.allclose(merged[i * n : (i + 1) * n].float(), ref, atol=2e-2)


def test_chunk_batch_with_a_cudnn_body_equals_flash_alone(rt, monkeypatch):
    """Chunks over long caches: body through cuDNN + the rest through flash, merged, equals the
    whole cache through flash (and writes the same K/V)."""
    from common.engine import lm as lm_module
    from common.engine.lm import Item

    lm = rt.lm
    if not lm.cudnn:
        pytest.skip(f"cuDNN attention does not run at head_dim {lm.head_dim} here")
    monkeypatch.setattr(lm, "bodies", lm_module.BodyPolicy(min_tokens=1024, bucket=512))
    torch.manual_seed(1)
    n, ats = 64, [1300, 1500, 1100, 1900]
    regions = [rt.pool.alloc(at + n) for at in ats]
    for r in regions:
        r.kv.normal_()
    items = [Item(n, r, at) for r, at in zip(regions, ats, strict=True)]
    q = torch.randn(len(items) * n, lm.n_heads, lm.head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, lm.n_kv_heads, len(items) * n, lm.head_dim, device="cuda", dtype=torch.bfloat16)
    plan = lm.plan(items)
    assert plan.body is not None and [length for _, length, _ in plan.body[2]] == [1024, 1024, 1024, 1536]
    lm._write(0, kv, plan)
    with_body = lm._attention(0, q, plan)
    monkeypatch.setattr(lm, "cudnn", False)
    plan = lm.plan(items)
    assert plan.body is None
    flash_alone = lm._attention(0, q, plan)  # the same K/V written
    assert torch.allclose(with_body.float(), flash_alone.float(), atol=2e-2)


# --------------------------------------------------------------------------- FP8 products (gemm_dtype: fp8)

# The 3B model's dense products as the engine runs them, (K in, N out, bias): the language model's
# fused qkv, o, fused gate_up and down; the vision blocks' qkv, proj, padded gate_up and down
QWEN_3B_PRODUCTS = [
    (2048, 2560, True),
    (2048, 2048, False),
    (2048, 22016, False),
    (11008, 2048, False),
    (1280, 3840, True),
    (1280, 1280, True),
    (1280, 6912, True),
    (3456, 1280, True),
]
FP8_TOKENS = (1, 7, 64, 333, 2048)  # a decode step to a chunk batch, odd counts among them


def _fp8_case(k: int, n: int, bias: bool):
    """A bf16 weight (N, K) at the 3B model's scale quantized, and a bias; activations with a few
    outlier channels, as transformer activations have (they set their rows' scales)."""
    from common.engine.fp8 import quantize_weight

    gen = torch.Generator(device="cuda").manual_seed(k + n)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(torch.bfloat16) if bias else None

    def activations(m: int) -> torch.Tensor:
        x = torch.randn(m, k, device="cuda", generator=gen)
        x[:, :8] *= 20
        return x.to(torch.bfloat16)

    return w, quantize_weight(w), b, activations


def _assert_fp8_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, qw, b) -> None:
    """`got` against the emulation the CPU oracles run (tests/test_fp8.py), from the same fp8
    values. Both sum exact products of those values in fp32 (in another order; even were Hopper's
    tensor cores to keep only about 14 bits inside a block, as DeepSeek-V3 reports of its FP8 GEMMs
    without promotion, that is some 1e-4 of these sums, estimated), scale and add the bias, then
    round to bf16: half a bf16 ulp each, so one ulp apart, 2^-7 of the value at most. Allowed: 2^-7
    of the value plus 2^-7 of the largest output (an ulp there, for the summation's part). A wrong
    scale axis, a transposed operand or a lost bias is off by tens of percent. The emulation itself
    is farther than the allowance from the unquantized product (3.8-6.6 times it on a CPU, these
    sides), so the comparison is not vacuous."""
    import torch.nn.functional as F

    from common.engine.fp8 import emulated_mm, quantize_rows

    xq, x_scale = quantize_rows(x)
    want = emulated_mm(xq, x_scale, qw, b).to(torch.bfloat16).float()
    allowance = 2**-7 * want.abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=allowance)
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert (want - exact).abs().max().item() > 2 * allowance


@pytest.mark.parametrize(("k", "n", "bias"), QWEN_3B_PRODUCTS, ids=[f"{k}x{n}" for k, n, _ in QWEN_3B_PRODUCTS])
def test_fp8_scaled_mm_equals_the_emulation_at_the_3b_models_sides(k, n, bias):
    """`torch._scaled_mm` (row-wise scales, bias in its epilogue, bf16 out) as `fp8_linear` calls
    it, at every dense product of the 3B model, against the emulation (see _assert_fp8_product)."""
    from common.engine.fp8 import fp8_linear

    w, qw, b, activations = _fp8_case(k, n, bias)
    assert qw.native, "sides of multiples of 16 on a Hopper GPU: through _scaled_mm"
    for m in FP8_TOKENS:
        x = activations(m)
        _assert_fp8_product(fp8_linear(x, qw, b), x, w, qw, b)


def test_fp8_products_compiled_equal_the_emulation():
    """As the engine runs them on a GPU: compiled (the activations' quantization fused by
    inductor, `_scaled_mm` an extern call), the token count dynamic. And a weight `_scaled_mm`
    cannot take (a side not a multiple of 16) goes through the emulation itself."""
    from common.engine.fp8 import emulated_mm, fp8_linear, quantize_rows, quantize_weight
    from common.engine.lm import tokens_vary

    compiled = torch.compile(fp8_linear)
    for k, n, bias in (QWEN_3B_PRODUCTS[0], QWEN_3B_PRODUCTS[3]):
        w, qw, b, activations = _fp8_case(k, n, bias)
        for m in FP8_TOKENS:
            x = activations(m)
            tokens_vary(x)
            _assert_fp8_product(compiled(x, qw, b), x, w, qw, b)
    odd = quantize_weight(torch.randn(40, 90, device="cuda").to(torch.bfloat16))
    assert not odd.native
    x = torch.randn(5, 90, device="cuda").to(torch.bfloat16)
    assert torch.equal(fp8_linear(x, odd), emulated_mm(*quantize_rows(x), odd, None).to(torch.bfloat16))


def test_fp8_streamed_answers_are_one_shot_inference_with_the_same_quantization(rt):
    """tiny-random in bf16 with FP8 products (every one through `_scaled_mm`, compiled, question
    steps from CUDA graphs) against transformers' one-shot forward with the same quantization.
    Not within 1e-4 as on a CPU in fp32 (tests/test_fp8.py): where the engine and transformers
    round a value a bf16 ulp apart, it lands on the other side of an fp8 rounding boundary about
    once in 30 (3 mantissa bits to 7), so in bf16 the two differ by a fraction of what the
    quantization itself moves. The oracle here: over 6 windows, the streamed first-token logits
    are nearer the same quantization's one-shot logits than bf16's, by a clear margin: their mean
    |difference| under 0.75 of that to bf16's (0.30-0.57 for 10 sets of 3 windows on a CPU in bf16,
    2026-11-28; not yet run on a GPU). An engine that left its products in bf16 would be nearer
    bf16's (a ratio above 1), one that quantized otherwise (per tensor, other scales) about as far
    from both (near 1)."""
    from common.engine.answer import ask
    from common.engine.grid import Grid
    from common.engine.model import load_model
    from common.engine.offline import offline_answer
    from common.engine.params import GenerationParams
    from common.engine.runtime import Runtime
    from tests.engine_helpers import QUESTION, make_frames, stream

    fp8 = Runtime(load_model("tiny-random", device="cuda", dtype="bfloat16", gemm_dtype="fp8"), pool_tokens=1 << 16)
    assert all(w.native for lw in fp8.lm.weights for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
    grid, fps, near, far = Grid(56, 56), 2.0, 0.0, 0.0
    for seed in range(6):
        frames = make_frames(8, grid, seed=100 + seed)
        version = stream(fp8, frames, grid, fps, 4).head
        streamed = ask(fp8, version, QUESTION, GenerationParams(max_tokens=4), keep_logits=True).first_logits
        same = offline_answer(fp8, frames, grid, fps, QUESTION, max_tokens=1).first_logits
        bf16 = offline_answer(rt, frames, grid, fps, QUESTION, max_tokens=1).first_logits
        near += (streamed.float().cpu() - same).abs().mean().item()
        far += (streamed.float().cpu() - bf16).abs().mean().item()
    assert near < 0.75 * far, f"mean |streamed - one-shot fp8| {near / 6:.4f}, to bf16's {far / 6:.4f}"


def test_a_question_graph_whose_capture_fails_runs_eagerly_and_serving_goes_on(rt, monkeypatch):
    """A capture the device refuses (here a synchronize inside it: `operation not permitted when
    stream is capturing`, the error that ended a 64-camera worker mid-serving) leaves that shape
    eager for good: the question answers as launched eagerly, the thread's CUDA stream is its own
    again, random ops on the device work (the failed capture left torch's generator capturing),
    and the next question of the shape is not captured again."""
    from common.engine import answer, step_graphs
    from common.engine.grid import Grid
    from common.engine.params import GenerationParams

    engine = _engine(rt, "capture-fails", Grid(56, 56), 2, 19)
    params = GenerationParams(max_tokens=6)
    rt.step_graphs = answer.StepGraphs(rt.lm, on_capture=rt.on_graph_capture)  # nothing captured yet
    step = step_graphs._Graph._step

    def refused(self):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while capturing: the capture fails
        return step(self)

    monkeypatch.setattr(step_graphs._Graph, "_step", refused)
    stream = torch.cuda.current_stream()
    got = answer.ask(rt, engine.head, "What happens?", params, keep_logits=True)
    assert torch.cuda.current_stream() == stream
    assert rt.step_graphs.failed and not rt.step_graphs.graphs
    assert torch.rand(2, device="cuda").shape == (2,), "the device's random generator works again"
    failed = set(rt.step_graphs.failed)
    again = answer.ask(rt, engine.head, "What happens?", params, keep_logits=True)
    assert rt.step_graphs.failed == failed and not rt.step_graphs.graphs
    monkeypatch.setattr(answer, "CUDA_GRAPHS", False)
    eager = answer.ask(rt, engine.head, "What happens?", params, keep_logits=True)
    assert got.token_ids == again.token_ids and got.token_ids[:4] == eager.token_ids[:4]
    assert_logits_close(got.first_logits, eager.first_logits)
