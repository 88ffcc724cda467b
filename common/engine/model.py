"""Loading Qwen2.5-VL: real weights by hub id or local path, or random weights built from config.

`tiny-random` is a few-layer model with a byte-level tokenizer built in-process: it runs the
exact code paths of the real model on a CPU in milliseconds, with no network. `random-3b` is
the full Qwen2.5-VL-3B architecture with random weights: it costs exactly the compute and
memory of the trained model, which is what benchmarks need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from common.engine.fp8 import GEMM_DTYPES, quantize_model
from common.engine.names import DEFAULT_MODEL, RANDOM_MODELS
from common.engine.positions import TemporalStep

SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5-VL special tokens, in id order from <|endoftext|> (151643) in the real vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN_FIRST_SPECIAL_ID = 151643


@dataclass(frozen=True)
class SpecialIds:
    im_start: int
    im_end: int
    endoftext: int
    vision_start: int
    vision_end: int
    video_pad: int


@dataclass
class LoadedModel:
    """The model, its tokenizer and the handful of facts every other module needs."""

    model: Qwen2_5_VLForConditionalGeneration
    tokenizer: PreTrainedTokenizerFast
    name: str
    ids: SpecialIds
    device: torch.device
    dtype: torch.dtype
    gemm_dtype: str = "bf16"  # "fp8": the dense layers' products in FP8 (fp8.py)

    @property
    def text_config(self):
        return self.model.config.text_config

    @property
    def vision_config(self):
        return self.model.config.vision_config

    @property
    def mrope_section(self) -> list[int]:
        return list(self.text_config.rope_parameters["mrope_section"])

    @property
    def temporal_patch_size(self) -> int:
        return int(self.vision_config.temporal_patch_size)

    def temporal_interval(self, fps: float) -> TemporalStep:
        """Temporal M-RoPE step per temporal patch: tokens_per_second * seconds_per_grid, as the release rounds it."""
        return TemporalStep.for_fps(fps, self.temporal_patch_size, int(self.vision_config.tokens_per_second))


def build_byte_tokenizer(vocab_size: int, first_special_id: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte, no merges) with Qwen's special tokens at
    `first_special_id`.. . Any text round-trips, so tests can ask real questions offline."""
    byte_vocab = {tok: i for i, tok in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    byte_vocab = {tok: i for i, tok in enumerate(sorted(byte_vocab))}
    specials = {tok: first_special_id + i for i, tok in enumerate(SPECIAL_TOKENS)}
    if first_special_id < len(byte_vocab) or first_special_id + len(SPECIAL_TOKENS) > vocab_size:
        raise ValueError("special ids must sit above the byte vocabulary and inside vocab_size")
    tok = Tokenizer(models.BPE(vocab={**byte_vocab, **specials}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return fast


def tiny_config(vocab_size: int = 320) -> Qwen2_5_VLConfig:
    first = 256
    ids = {name: first + i for i, name in enumerate(SPECIAL_TOKENS)}
    return _config(
        ids,
        text=dict(
            vocab_size=vocab_size,
            initializer_range=0.2,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision=dict(
            depth=4,
            hidden_size=32,
            num_heads=4,
            intermediate_size=64,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[1, 3],
        ),
    )


def qwen3b_config() -> Qwen2_5_VLConfig:
    ids = {name: QWEN_FIRST_SPECIAL_ID + i for i, name in enumerate(SPECIAL_TOKENS)}
    return _config(
        ids,
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            num_heads=16,
            intermediate_size=3420,
            out_hidden_size=2048,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
    )


def _config(ids: dict[str, int], *, text: dict, vision: dict) -> Qwen2_5_VLConfig:
    vision = dict(
        patch_size=14, temporal_patch_size=2, spatial_merge_size=2, tokens_per_second=2, in_channels=3, **vision
    )
    text = dict(
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        **text,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    device: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    gemm_dtype: str = "bf16",
) -> LoadedModel:
    """`tiny-random`, `random-3b`, a hub id or a local directory. bf16 on GPU, fp32 on CPU.
    `gemm_dtype` "fp8": the dense layers' weights quantized to FP8 (fp8.py), for the engine and
    for transformers' own forward alike; "bf16": as loaded (the model's dtype)."""
    if gemm_dtype not in GEMM_DTYPES:
        raise ValueError(f"gemm_dtype {gemm_dtype!r}: one of {', '.join(GEMM_DTYPES)}")
    dev = pick_device(device)
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if name in RANDOM_MODELS:
        config = tiny_config() if name == "tiny-random" else qwen3b_config()
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        with torch.device(dev):
            model = Qwen2_5_VLForConditionalGeneration(config).to(torch_dtype)
        first = 256 if name == "tiny-random" else QWEN_FIRST_SPECIAL_ID
        tokenizer = build_byte_tokenizer(config.text_config.vocab_size, first)
    else:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(name, dtype=torch_dtype, attn_implementation="sdpa")
        model = model.to(dev)
        tokenizer = AutoTokenizer.from_pretrained(name)
    model.eval()
    if gemm_dtype == "fp8":
        quantize_model(model)
    return LoadedModel(model, tokenizer, name, _special_ids(tokenizer), dev, torch_dtype, gemm_dtype)


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> SpecialIds:
    def tid(tok: str) -> int:
        i = tokenizer.convert_tokens_to_ids(tok)
        if i is None or i == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {tok}: not a Qwen2.5-VL tokenizer")
        return int(i)

    return SpecialIds(
        im_start=tid("<|im_start|>"),
        im_end=tid("<|im_end|>"),
        endoftext=tid("<|endoftext|>"),
        vision_start=tid("<|vision_start|>"),
        vision_end=tid("<|vision_end|>"),
        video_pad=tid("<|video_pad|>"),
    )
