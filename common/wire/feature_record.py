"""A chunk's retrieval features on the wire: `svqa:{cam}:features` entries, encoder -> recorder.

One msgpack map (schema version ``v``) in the field ``m``, like frames and manifests: the chunk's
capture-time range, frame seqs and frame count (what a search hit names, and what a
history answer reads back from the log), the model and layers the vector was
taken at (vectors of another model or other layers are not comparable), and the vector itself,
float16 little-endian (2 KB at Qwen2.5-VL-3B: 4 layers x 2 KV heads x 128). The vector is the
model's own (common/engine/features.py); no torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.wire.schemas import FIELD, SchemaError, _float, _get_field, _int, _pack, _pair, _str, _unpack

# Entries a camera's features stream keeps (XADD MAXLEN ~): 33 minutes of 2-s chunks. The recorder
# acks them once its index is saved (every features_save_s) and trims what it acked.
FEATURES_MAXLEN = 1000
MAX_DIM = 1 << 16
MAX_LAYERS = 256
MAX_MODEL_CHARS = 256
MAX_FEATURES_BYTES = 2 * MAX_DIM + 4096


@dataclass(frozen=True)
class ChunkFeatures:
    capture_range: tuple[float, float]  # the chunk's first and last frame's capture time
    frame_seqs: tuple[int, int]
    frames: int  # how many frames it was encoded from (its seqs may skip frames the encoder dropped)
    model: str
    layers: tuple[int, ...]
    vector: np.ndarray  # (dim,) float16, each layer's part at unit length

    def __post_init__(self) -> None:
        t0, t1 = _pair("t", self.capture_range, _float)
        if t1 < t0:
            raise SchemaError("t", f"range ends before it starts ({t0} > {t1})")
        _pair("seqs", self.frame_seqs, lambda n, v: _int(n, v, 0))
        _int("frames", self.frames, 1)
        _str("model", self.model, MAX_MODEL_CHARS)
        if not 1 <= len(self.layers) <= MAX_LAYERS:
            raise SchemaError("layers", f"expected 1..{MAX_LAYERS} layers, got {len(self.layers)}")
        for i, layer in enumerate(self.layers):
            _int(f"layers[{i}]", layer, 0, MAX_LAYERS)
        v = self.vector
        if v.dtype != np.float16 or v.ndim != 1 or not 0 < v.size <= MAX_DIM or v.size % len(self.layers):
            raise SchemaError(
                "vec", f"expected float16 (dim,) in parts of {len(self.layers)} layers, got {v.dtype}{v.shape}"
            )
        if not np.isfinite(v).all():
            raise SchemaError("vec", "not finite")


def encode_features(f: ChunkFeatures) -> dict[str, bytes]:
    """Stream fields for XADD to ``keys.features(cam)``."""
    m = {
        "t": list(f.capture_range),
        "seqs": list(f.frame_seqs),
        "frames": f.frames,
        "model": f.model,
        "layers": list(f.layers),
        "vec": f.vector.astype("<f2").tobytes(),
    }
    return {FIELD: _pack(m)}


def decode_features(fields: Mapping[Any, Any]) -> ChunkFeatures:
    """Validate one features entry; SchemaError naming the field."""
    m = _unpack(_get_field(fields, FIELD), MAX_FEATURES_BYTES)
    raw = m.get("vec")
    if not isinstance(raw, bytes) or len(raw) % 2:
        raise SchemaError("vec", "expected float16 bytes")
    layers = m.get("layers")
    if not isinstance(layers, list):
        raise SchemaError("layers", "expected a list")
    return ChunkFeatures(  # the rest is checked in __post_init__
        capture_range=_pair("t", m.get("t"), _float),
        frame_seqs=_pair("seqs", m.get("seqs"), lambda n, v: _int(n, v, 0)),
        frames=m.get("frames"),  # type: ignore[arg-type]
        model=m.get("model"),  # type: ignore[arg-type]
        layers=tuple(layers),
        vector=np.frombuffer(raw, dtype="<f2").astype(np.float16),
    )
