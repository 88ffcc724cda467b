"""A stream's description on the wire: the hash ingest writes under `keys.meta(cam)`.

The one conversion between that hash and the engine's `StreamSpec`. Ingest writes it (and
re-states it with every frame, so a Redis that lost its data relearns it); the encoder, status
and the API read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.engine.grid import FrameError, Grid, StreamSpec
from common.wire.schemas import SchemaError, check_grid


@dataclass(frozen=True)
class StreamMeta:
    fps: float
    grid: Grid
    live: bool  # capture times are wall-clock (a camera, or a file paced like one)
    url: str = ""  # the source, credentials already redacted

    def to_hash(self) -> dict[str, str]:
        return {
            "fps": repr(self.fps),
            "height": str(self.grid.height),
            "width": str(self.grid.width),
            "live": "1" if self.live else "0",
            "url": self.url,
        }

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> StreamMeta | None:
        """None for a stream ingest has not described yet; SchemaError for a malformed hash."""
        if not raw:
            return None
        d = {_text(k): _text(v) for k, v in raw.items()}
        try:
            fps = float(d["fps"])
            grid = Grid(int(d["height"]), int(d["width"]))
        except KeyError as e:
            raise SchemaError(f"meta.{e.args[0]}", "missing") from None
        except (ValueError, FrameError) as e:
            raise SchemaError("meta", str(e)) from None
        if not fps > 0:
            raise SchemaError("meta.fps", f"must be positive, got {d['fps']}")
        check_grid("meta.grid", grid.height, grid.width)
        return cls(fps, grid, d.get("live") == "1", d.get("url", ""))

    def spec(self, name: str, chunk_frames: int) -> StreamSpec:
        return StreamSpec(name, self.fps, self.grid, chunk_frames)


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
