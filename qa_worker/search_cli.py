"""`streamvqa search "red van" [--stream cam1 | --all] [--since 6h] [--until 1h] [--limit 10]`:
the cameras' past, ranked by the model's own retrieval features (README "Search").

One line per result (a moment: a camera's adjacent matching chunks, qa_worker/moments.py) on
stdout, best first: score (its best chunk's), camera, the capture-time range in this machine's
local time, the frame seqs, how many chunks, and the best chunk's time range; `--json`: one JSON
object per result instead. Nothing found prints nothing (and says so on stderr). A bad parameter
or an unknown camera exits 2 before anything is sent; a worker's error exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import redis

from common import boot
from common.config import RedisSettings, add_tool_flags
from common.logs import configure_logging, redact_url
from common.wire.schemas import SchemaError, SearchHit
from common.wire.search_request import DEFAULT_LIMIT, MAX_LIMIT, checked_search
from qa_worker.client import Client, _time_ref, checked_timeout


def main(argv: list[str]) -> int:
    prog = "streamvqa search"
    p = argparse.ArgumentParser(prog=prog, description="Search the cameras' past: ranked time ranges")
    add_tool_flags(p, RedisSettings, ["redis_url"])
    p.add_argument("text", help="what to look for (a question or a description)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--stream", help="one camera's stream name")
    which.add_argument("--all", action="store_true", help="every camera (the default)")
    p.add_argument(
        "--since",
        help="only chunks captured since: seconds before now (90, 15m, 6h, 1d) or an ISO 8601 time "
        "(without an offset, this machine's time)",
    )
    p.add_argument("--until", help="only chunks captured until, in the same forms (default: now)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"ranges, 1..{MAX_LIMIT} (default {DEFAULT_LIMIT})")
    p.add_argument("--json", action="store_true", help="one JSON object per result")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the worker")
    ns = p.parse_args(argv[1:])
    configure_logging("WARNING")
    try:  # refused here, before a round trip, as a worker would refuse it
        options = {"stream": ns.stream, "limit": ns.limit}
        options |= {name: _time_ref(name, getattr(ns, name)) for name in ("since", "until")}
        checked_search(ns.text, **options)
        checked_timeout(ns.timeout)
    except SchemaError as e:
        boot.fail(boot.EXIT_CONFIG, "bad search", service=prog, error=str(e))
    client = Client(boot.connect_tool(ns.redis_url, prog))
    try:
        if ns.stream is not None and not client.known(ns.stream):
            where = {"stream": ns.stream, "redis": redact_url(ns.redis_url)}
            boot.fail(boot.EXIT_CONFIG, "unknown stream", service=prog, **where)
        final = client.search(ns.text, timeout_s=ns.timeout, **options)
    except redis.RedisError as e:
        boot.fail(boot.EXIT_REDIS, "redis failed", service=prog, error=str(e))
    except TimeoutError as e:
        boot.fail(1, "no answer", service=prog, error=str(e))
    if final.error is not None:
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    for hit in final.hits or ():
        print(json.dumps(vars(hit)) if ns.json else line(hit))
    if not final.hits:
        print("no chunk of that span is indexed", file=sys.stderr)
    return 0


def line(hit: SearchHit) -> str:
    fmt = "%Y-%m-%d %H:%M:%S"
    start, end = time.strftime(fmt, time.localtime(hit.start)), _clock(hit.end)
    frames, best = f"frames {hit.first_seq}-{hit.last_seq}", f"best {_clock(hit.best_start)}..{_clock(hit.best_end)}"
    return f"{hit.score:.3f}  {hit.stream}  {start}..{end}  {frames}  chunks {hit.chunks}  {best}"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))
