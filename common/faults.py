"""Named kill points: where a chunk's persistence may be cut by a crash (docs/DESIGN.md, "A
version's life"), so that tests can kill a worker at exactly that place.

``SVQA_KILL_AT=persist.before_publish`` makes the process SIGKILL itself the first time it passes
``fault_point("persist.before_publish")``; ``persist.before_publish:3`` the third time. The
variable is read once, at import; unset, a fault point is one comparison. Tests that fork lives
from a parent that imported this module already call `arm` in the child instead.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "SVQA_KILL_AT"
POINTS = (
    "persist.copy_queued",  # a segment's host copy handed to the writer's queue, not yet written
    "persist.before_publish",  # the version's segments written, its manifest not yet published
    "persist.before_ack",  # the manifest published, the chunk's frames not yet acked
    "persist.mid_gc",  # between deleting two segments that no kept version names
    "persist.mid_restore",  # a head's segments partly read by the stream's new owner
)

_armed: tuple[str, int] | None = None  # (point, the pass that kills)
_passes = 0
_lock = threading.Lock()


def arm(spec: str | None) -> None:
    """``name`` or ``name:N`` (the Nth pass kills); None or empty disarms."""
    global _armed, _passes
    _passes = 0
    if not spec:
        _armed = None
        return
    name, _, nth = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}: unknown fault point {name!r} (one of {', '.join(POINTS)})")
    if nth and (not nth.isdigit() or int(nth) < 1):
        raise ValueError(f"{ENV}: the pass must be a positive integer, got {nth!r}")
    _armed = (name, int(nth or 1))


def fault_point(name: str) -> None:
    """Die here, as SIGKILL would kill the process (no handler, no cleanup), if armed for this pass."""
    global _passes
    if _armed is None or _armed[0] != name:
        return
    with _lock:
        _passes += 1
        if _passes >= _armed[1]:
            os.kill(os.getpid(), signal.SIGKILL)


arm(os.environ.get(ENV))
