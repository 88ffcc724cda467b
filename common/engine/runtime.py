"""The model on a device: weights, our language-model runner, the tokenizer. Shared by every stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tokenizers import Tokenizer

from common.engine.eviction import EvictionPolicy
from common.engine.grid import StreamSpec
from common.engine.kvcache import StreamCache
from common.engine.lm import LanguageModel
from common.engine.model import SYSTEM_PROMPT, LoadedModel
from common.engine.pool import PAGE_TOKENS, KVPool, token_bytes
from common.engine.step_graphs import StepGraphs
from common.engine.vision import COMPILED_MIN_TOKENS, GridTHW, VisionTower
from common.engine.work import Executor, InlineExecutor

POOL_RESERVE_BYTES = 8 << 30  # left free on the GPU for activations (vision and prefill batches)...
RESERVE_CHUNKS = 8  # ...of up to this many chunks an encode step; more: the reserve grows in step
CPU_SLAB_TOKENS = 1 << 16
GPU_GROW_TOKENS = 1 << 16  # the least a GPU pool grows by once its first slab is full (2.4 GB at 3B)
# Room in the pool beside the streams' budgets, in budgets: chunks over budget at once (up to a
# batch's worth), copy-on-write evictions (a whole cache each), questions' scratch.
SPARE_BUDGETS = 4


class Runtime:
    """A loaded model plus our language-model runner; shared by every stream on a device."""

    def __init__(
        self,
        loaded: LoadedModel,
        pool_tokens: int | None = None,
        compile_vision: bool = True,
        vision_compile_min_tokens: int = COMPILED_MIN_TOKENS,
        page_tokens: int = PAGE_TOKENS,
        vision_graphs: bool = False,
        on_graph_capture: Callable[[float], None] | None = None,
        max_chunks: int = RESERVE_CHUNKS,
    ):
        """`pool_tokens`: KV slots to allocate up front (default: what the GPU has free, less
        `POOL_RESERVE_BYTES` for activations; on the CPU slabs of `CPU_SLAB_TOKENS` as needed).
        `compile_vision`: torch.compile the vision blocks, on a GPU only (there it takes a batch of
        16 448² chunks from 10.3 to 7.9 ms a chunk; on a CPU inductor spends a minute building C++
        for little gain), for batches of at least `vision_compile_min_tokens` patches.
        `page_tokens`: the pool's page (pool.py). `vision_graphs`: compiled vision batches are
        replayed from CUDA graphs (vision.py). `on_graph_capture(seconds)`: after each CUDA graph
        captured, the vision tower's and the question steps' (metrics). `max_chunks`: the most
        chunks an encode step batches (the activations reserve scales with it: 16 at the 8-chunk
        reserve ran out of memory in the warm-up, H200)."""
        self.loaded = loaded
        # before the pool, which takes what memory is left: the tower holds a padded MLP copy
        backend = "inductor" if compile_vision and loaded.device.type == "cuda" else None
        self.vision_tower = VisionTower(loaded, backend, vision_compile_min_tokens, vision_graphs, on_graph_capture)
        reserve = POOL_RESERVE_BYTES * max(1, -(-max_chunks // RESERVE_CHUNKS))
        self.pool = _make_pool(loaded, pool_tokens, page_tokens, reserve)
        self.lm = LanguageModel(loaded, self.pool)
        self.tokenizer = loaded.tokenizer
        self._user_tokenizer = Tokenizer.from_str(loaded.tokenizer.backend_tokenizer.to_str())
        self._user_tokenizer.encode_special_tokens = True
        self.ids = loaded.ids
        self.device = loaded.device
        # Who runs GPU work: alone and at once by default; a service installs a Scheduler that
        # batches every stream's chunks and every question's steps.
        self.executor: Executor = InlineExecutor()
        self.step_graphs: StepGraphs | None = None  # built on the first question step on a GPU
        self.on_graph_capture = on_graph_capture

    def encode(self, text: str, *, user: bool = False) -> list[int]:
        """Token ids of ``text``. ``user=True`` for anything a person wrote: special-token parsing
        is off, so ``<|im_start|>`` in a question is ordinary text, never a control token.

        User text goes through its own copy of the tokenizer with that setting fixed: transformers'
        `split_special_tokens` flips a flag on the shared Rust tokenizer for the call, which races
        when questions are tokenized in several threads at once."""
        if user:
            return self._user_tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def streams_fit(self, budget_tokens: int | None, beside_tokens: int = 0) -> int | None:
        """How many streams of `budget_tokens` the KV pool holds with `SPARE_BUDGETS` to spare and
        `beside_tokens` kept for others (questions' temporary caches); None when either is unbounded
        (no budget, or a CPU pool, which grows as needed)."""
        limit = self.pool.limit_tokens()
        if budget_tokens is None or limit is None:
            return None
        return max(0, (limit - beside_tokens) // self.in_pages(budget_tokens) - SPARE_BUDGETS)

    def live_tokens(self, streams: int, budget_tokens: int) -> int:
        """The KV pool tokens `streams` live streams of `budget_tokens` are guaranteed: each its
        budget, and `SPARE_BUDGETS` more for what they take beside it."""
        return (streams + SPARE_BUDGETS) * self.in_pages(budget_tokens)

    def in_pages(self, tokens: int) -> int:
        """`tokens` in whole pages, as the pool holds them."""
        return self.pool.pages_for(tokens) * self.pool.page_tokens

    def prefix_ids(self, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
        return self.encode(f"<|im_start|>system\n{system_prompt}<|im_end|>\n<|im_start|>user\n<|vision_start|>")

    def vision(self, pixels: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        """One chunk's merged video embeddings (a batch of one)."""
        return self.vision_batch([(pixels, grid_thw)])[0]

    def vision_batch(self, chunks: Sequence[tuple[torch.Tensor, GridTHW]]) -> list[torch.Tensor]:
        """Merged vision embeddings of several chunks (pixels, grid_thw) of any streams and grids,
        in order, from one forward; each equals that chunk encoded alone."""
        return [embeds.to(self.lm.dtype) for embeds in self.vision_tower(chunks)]

    def new_cache(self, spec: StreamSpec, policy: EvictionPolicy) -> StreamCache:
        """An empty cache for one stream on this device (its positions follow the stream's fps and grid)."""
        return StreamCache(
            self.lm, spec.name, policy, interval=self.loaded.temporal_interval(spec.fps), grid_hw=spec.grid.merged_hw
        )


def _make_pool(loaded: LoadedModel, pool_tokens: int | None, page_tokens: int, reserve: int) -> KVPool:
    cfg = loaded.text_config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    if loaded.device.type != "cuda":
        return KVPool(shape, loaded.dtype, loaded.device, pool_tokens or CPU_SLAB_TOKENS, page_tokens=page_tokens)
    if pool_tokens is None:
        torch.cuda.empty_cache()  # what loading left cached is free memory too (7.7 GiB at random-3b)
        free, _ = torch.cuda.mem_get_info(loaded.device)
        pool_tokens = max(1 << 16, (free - reserve) // token_bytes(shape, loaded.dtype))
    grow = min(pool_tokens, GPU_GROW_TOKENS)
    pool = KVPool(shape, loaded.dtype, loaded.device, pool_tokens, grow, reserve, page_tokens)
    pool.alloc(1)  # the first slab now: one allocation, before activations fragment the device
    return pool
