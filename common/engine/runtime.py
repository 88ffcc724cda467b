"""The model on a device: weights, our language-model runner, the tokenizer. Shared by every stream."""

from __future__ import annotations

import threading

import torch

from common.engine.eviction import EvictionPolicy
from common.engine.grid import StreamSpec
from common.engine.kvcache import StreamCache
from common.engine.lm import LanguageModel
from common.engine.model import SYSTEM_PROMPT, LoadedModel


class Runtime:
    """A loaded model plus our language-model runner; shared by every stream on a device."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.lm = LanguageModel(loaded)
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

    @torch.inference_mode()
    def vision(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        visual = self.loaded.model.model.visual
        grid = torch.tensor([grid_thw], device=self.loaded.device)
        out = visual(pixels.to(self.loaded.device, visual.dtype), grid_thw=grid)
        return out.pooler_output.to(self.lm.dtype)

    def new_cache(self, spec: StreamSpec, policy: EvictionPolicy) -> StreamCache:
        """An empty cache for one stream on this device (its positions follow the stream's fps and grid)."""
        return StreamCache(self.lm, spec.name, policy, interval=self.loaded.temporal_interval(spec.fps),
                           grid_hw=spec.grid.merged_hw)  # fmt: skip
