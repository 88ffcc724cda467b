"""The model on a device: weights, our language-model runner, the tokenizer. Shared by every stream."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from common.engine.eviction import EvictionPolicy
from common.engine.grid import StreamSpec
from common.engine.kvcache import StreamCache
from common.engine.lm import LanguageModel
from common.engine.model import SYSTEM_PROMPT, LoadedModel
from common.engine.vision import GridTHW, VisionTower


class Runtime:
    """A loaded model plus our language-model runner; shared by every stream on a device."""

    def __init__(self, loaded: LoadedModel, compile_vision: bool = False):
        self.loaded = loaded
        self.lm = LanguageModel(loaded)
        # compiling is for the GPU: on a CPU inductor spends a minute building C++ for little gain
        backend = "inductor" if compile_vision and loaded.device.type == "cuda" else None
        self.vision_tower = VisionTower(loaded, compile_backend=backend)
        self.tokenizer = loaded.tokenizer
        self.ids = loaded.ids
        self.device = loaded.device
        # One GPU does one forward at a time; the lock keeps encoder and QA threads from
        # interleaving inside a forward (cheaper than the memory of concurrent activations).
        self.gpu_lock = threading.RLock()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prefix_ids(self, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
        return self.encode(f"<|im_start|>system\n{system_prompt}<|im_end|>\n<|im_start|>user\n<|vision_start|>")

    def vision(self, pixels: torch.Tensor, grid_thw: GridTHW) -> torch.Tensor:
        """One chunk's merged video embeddings (a batch of one)."""
        return self.vision_batch([(pixels, grid_thw)])[0]

    def vision_batch(self, chunks: Sequence[tuple[torch.Tensor, GridTHW]]) -> list[torch.Tensor]:
        """Chunks of any streams and grids in one vision forward; each result equals that chunk
        encoded alone."""
        return [embeds.to(self.lm.dtype) for embeds in self.vision_tower(chunks)]

    def new_cache(self, spec: StreamSpec, policy: EvictionPolicy) -> StreamCache:
        """An empty cache for one stream on this device (its positions follow the stream's fps and grid)."""
        return StreamCache(self.lm, spec.name, policy, interval=self.loaded.temporal_interval(spec.fps),
                           grid_hw=spec.grid.merged_hw)  # fmt: skip
