"""`streamvqa segments save DIR` / `load DIR`: the cache's segments carried over a planned reboot.

The default store (`shm://`) lies in the host's shared memory: it outlives a worker, not the
host. After a reboot every stream is rebuilt from the frames log, its whole window encoded again
(about 128 chunks a camera at 32K tokens: minutes of a GPU at 64 cameras). A planned reboot need
not pay that: with the workers stopped (their leases gone, so nothing writes), `save` copies every
segment to a directory on a disk, fsynced, and after the boot, before the workers start, `load`
copies them back. The workers then restore each stream from its head as after a crash (README
"What survives what"), reading Redis's heads (its AOF) and these segments.

Every segment is read through the store, so its checksum is checked: one that is damaged is left
out and named, and its stream is rebuilt from the frames log (or starts over) at restore, as any
damaged segment's is; the others are unaffected. A save leaves in DIR exactly the segments it
copied (an earlier save's copy of one found damaged now would come back at load, whole and
checked, as another life's K/V: segment ids repeat when a stream is rebuilt) and writes DIR/SAVED
last; `load` takes only a directory with it, so a save cut short is never loaded. `load` leaves
a segment the store already holds whole as it is: written after the save (a worker started
before the load), it is newer than the saved copy, which may be another life's K/V. Exit 0 when
every segment was copied, 1 when some were damaged (the rest copied), 2 on a bad store or
directory, 3 when Redis is unusable or a worker still holds a stream, 4 when a segment cannot be
written (a full disk): run it again once there is room.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
from tqdm import tqdm

from common import boot
from common.config import ModelSettings, RedisSettings, add_tool_flags
from common.files import fsync_dir
from common.logs import configure_logging
from common.segment_store import DirectoryStore, SegmentStoreError, open_store
from common.wire import keys

SUFFIX = ".seg"  # the directory store's segment files (segment_store.py)
MARKER = "SAVED"  # a whole save's last file: its summary
THREADS = 8  # segments copied at once: reads, checksums and writes release the GIL
EXIT_DAMAGED, EXIT_WRITE = 1, 4


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="streamvqa segments", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["save", "load"], help="save: the store to DIR; load: DIR to the store")
    p.add_argument("dir", type=Path, help="a directory on a disk that outlives the reboot")
    add_tool_flags(p, ModelSettings, ["segment_store"])
    add_tool_flags(p, RedisSettings, ["redis_url"])
    ns = p.parse_args(argv[1:])
    configure_logging("WARNING")
    prog = f"streamvqa segments {ns.action}"
    store = _directory_store(ns.segment_store, prog)
    saved = DirectoryStore(ns.dir)  # durable: fsynced
    _check_dirs(ns.action, store.root, ns.dir, prog)
    try:
        held = _held_streams(boot.connect_tool(ns.redis_url, prog))
    except redis.RedisError as e:  # a user that may not SCAN (the `client` one), say
        boot.fail(boot.EXIT_REDIS, "cannot list the leases", service=prog, error=f"{e} (the worker user may)")
    if held:
        boot.fail(
            boot.EXIT_REDIS,
            "workers still hold streams",
            service=prog,
            error=f"{len(held)} streams are held ({', '.join(held[:5])}): stop the workers first, or a segment "
            "copied while written is damaged",
        )
    source, dest = (store, saved) if ns.action == "save" else (saved, store)
    try:
        if ns.action == "save":
            (ns.dir / MARKER).unlink(missing_ok=True)  # until this save is whole, DIR holds none
        # A segment the store already holds whole was written since the save (a worker ran after
        # the boot): the saved copy is older, maybe another life's K/V under the same id.
        summary, written = copy(source, dest, progress=sys.stderr.isatty(), replace=ns.action == "save")
        if ns.action == "save":
            _prune(ns.dir, written)
            _mark(ns.dir, summary)
    except (SegmentStoreError, OSError) as e:  # a write: the source is fine, the destination has no room
        boot.fail(EXIT_WRITE, "cannot write segments", service=prog, error=str(e))
    print(json.dumps({"action": ns.action, "from": str(source.root), "to": str(dest.root), **summary}))
    return EXIT_DAMAGED if summary["damaged"] else 0


def _check_dirs(action: str, store: Path, saved: Path, prog: str) -> None:
    """Exit 2 unless what is read is a directory (a save's, for load) and DIR can be one."""
    error = None
    if saved.exists() and not saved.is_dir():
        error = f"{saved} is not a directory"
    elif action == "save" and not store.is_dir():
        error = f"the segment store {store} is no directory: the workers' segment_store?"
    elif action == "load" and not (saved / MARKER).is_file():
        error = f"{saved} holds no whole save (its {MARKER} file)"
    if error is not None:
        boot.fail(boot.EXIT_CONFIG, "bad configuration", service=prog, error=error)


def _prune(root: Path, written: set[tuple[str, str]]) -> None:
    """Delete the segments under `root` this save did not write: an earlier save's."""
    for stream, segment_id in set(_segments(root)) - written:
        (root / stream / (segment_id + SUFFIX)).unlink(missing_ok=True)


def _mark(root: Path, summary: dict) -> None:
    """DIR/SAVED, written and fsynced last: the save is whole."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / MARKER, "w") as f:
        json.dump(summary, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(root)


def copy(
    source: DirectoryStore, dest: DirectoryStore, progress: bool = False, replace: bool = True
) -> tuple[dict, set[tuple[str, str]]]:
    """Every segment of ``source`` into ``dest``, each read (its checksum checked) and written
    whole as the store writes one; what was copied, the segments found damaged (left out) and,
    unless ``replace``, how many ``dest`` already held whole (left as they are), and which
    (stream, segment id) were written. A segment that cannot be written raises SegmentStoreError."""
    segments = list(_segments(source.root))
    damaged: list[str] = []
    written: set[tuple[str, str]] = set()
    copied_bytes = held = 0
    t0 = time.perf_counter()

    def one(stream: str, segment_id: str) -> int | SegmentStoreError | None:
        if not replace and _holds(dest, stream, segment_id):
            return None
        try:
            kv, epoch = source.get(stream, segment_id), _epoch(source, stream, segment_id)
        except SegmentStoreError as e:
            return e
        dest.put(stream, segment_id, kv, epoch=epoch)  # still the K/V of its life: checked at restore
        return kv.numel() * kv.element_size()

    with ThreadPoolExecutor(THREADS) as pool, tqdm(total=len(segments), unit="seg", disable=not progress) as bar:
        futures = {pool.submit(one, *s): s for s in segments}
        for future, (stream, segment_id) in futures.items():
            done = future.result()
            if done is None:
                held += 1
            elif isinstance(done, SegmentStoreError):
                damaged.append(f"{stream}/{segment_id}: {done}")
            else:
                copied_bytes += done
                written.add((stream, segment_id))
            bar.update()
    return {
        "segments": len(segments) - len(damaged) - held,
        "already_held": held,
        "bytes": copied_bytes,
        "seconds": round(time.perf_counter() - t0, 2),
        "damaged": damaged,
    }, written


def _epoch(store: DirectoryStore, stream: str, segment_id: str) -> str | None:
    """The stream's life a record names as its own (None: written before records named it)."""
    with store.open(stream, segment_id) as (meta, _, _):
        return meta.get("epoch")


def _holds(store: DirectoryStore, stream: str, segment_id: str) -> bool:
    """Whether ``store`` holds the segment whole (a damaged copy is replaced)."""
    try:
        store.get(stream, segment_id)
    except SegmentStoreError:
        return False
    return True


def _segments(root: Path) -> Iterator[tuple[str, str]]:
    """(stream, segment id) of every whole segment under ``root`` (not a writer's leftover)."""
    for stream in sorted(os.scandir(root), key=lambda e: e.name) if root.is_dir() else ():
        if stream.is_dir() and not stream.name.startswith("."):
            for entry in sorted(os.scandir(stream.path), key=lambda e: e.name):
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    yield stream.name, entry.name[: -len(SUFFIX)]


def _directory_store(url: str, prog: str) -> DirectoryStore:
    """The store as a directory, or exit 2: a Redis or in-process store has nothing to carry."""
    try:
        store = open_store(url) if url.startswith(("shm://", "dir://")) or "://" not in url else None
    except SegmentStoreError as e:
        boot.fail(boot.EXIT_CONFIG, "bad configuration", service=prog, error=str(e))
    if not isinstance(store, DirectoryStore):
        boot.fail(
            boot.EXIT_CONFIG,
            "bad configuration",
            service=prog,
            error=f"segment_store {url!r} is not a directory (shm:// or dir://): nothing to carry over a reboot",
        )
    return store


def _held_streams(r: redis.Redis) -> list[str]:
    """The streams a worker holds now (their leases), by name."""
    pattern = keys.lease("*")
    return sorted(k.decode().split("{", 1)[1].split("}", 1)[0] for k in r.scan_iter(match=pattern, count=1000))
