"""Two file-system steps the durable stores share (the frames log, the segment store's directory)."""

from __future__ import annotations

import os
from pathlib import Path


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until done: a raw write may take part of the buffer (a disk filling up takes what
    fits, and only the next write says ENOSPC). The GIL is released while the kernel copies."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: Path) -> None:
    """Make a directory's entries durable: a rename or a new file survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
