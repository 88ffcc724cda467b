"""Damaged video files for tests: cut off, corrupted in the middle, or not video at all."""

from __future__ import annotations

import numpy as np


def truncate_file(path: str, keep_fraction: float, dest: str | None = None) -> str:
    """Keep the first ``keep_fraction`` of the bytes (simulates a cut-off download/recording).

    Writes to ``dest`` (default: in place) and returns the path written.
    """
    if not 0.0 <= keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in [0, 1], got {keep_fraction}")
    with open(path, "rb") as f:
        data = f.read()
    target = dest or path
    with open(target, "wb") as f:
        f.write(data[: int(len(data) * keep_fraction)])
    return target


def corrupt_bytes(
    path: str, *, start_fraction: float = 0.5, length: int = 4096, seed: int = 0, dest: str | None = None
) -> str:
    """Overwrite ``length`` bytes starting at ``start_fraction`` of the file with seeded noise.

    The file keeps its size and headers, so it opens but some packets fail to decode.
    Writes to ``dest`` (default: in place) and returns the path written.
    """
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start = int(len(data) * start_fraction)
    end = min(len(data), start + length)
    data[start:end] = np.random.default_rng(seed).integers(0, 256, end - start, dtype=np.uint8).tobytes()
    target = dest or path
    with open(target, "wb") as f:
        f.write(data)
    return target


def write_garbage_file(path: str, size: int = 64 * 1024, seed: int = 0) -> str:
    """A file of seeded random bytes: no container format can open it."""
    with open(path, "wb") as f:
        f.write(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path
