"""Points inside a long forward where the GPU loop may launch other, short work.

An encode step (a vision forward and a chunk prefill for many streams) keeps the GPU 100-200 ms.
Questions being answered need a decode step every few milliseconds; waiting for the whole encode
step is most of what an answer costs while cameras stream. So the vision and language layer loops
call `between_layers()`, and the scheduler, while it runs an encode step, installs a hook there
(`interleaved`) that completes the decode step in flight, if the device has finished it, and
launches the next one on a high-priority CUDA stream: decoding runs beside the encode step instead
of after it. The chunk loop that publishes the step's versions calls `between_outputs()` after
each one: 64 cameras evicting within seconds made steps of 8 re-layouts, 200 ms of host work
during which no decode step was launched. Without a hook (everywhere but inside an encode step)
both do nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


def between_layers() -> None:
    """A point where the hook of `interleaved`, if any, runs."""
    hook: Callable[[], None] | None = getattr(_local, "hook", None)
    if hook is None:
        return
    _local.hook = None  # the hook's own forwards (an eager decode step) do not call it again
    try:
        hook()
    finally:
        _local.hook = hook


# The same point between the chunks an encode step publishes (an eviction's re-layout is tens of
# milliseconds of host work); its own name says where it is called from.
between_outputs = between_layers


@contextmanager
def interleaved(hook: Callable[[], None]) -> Iterator[None]:
    """Call `hook()` at every `between_layers()` and `between_outputs()` of this thread until the
    block ends."""
    previous = getattr(_local, "hook", None)
    _local.hook = hook
    try:
        yield
    finally:
        _local.hook = previous
