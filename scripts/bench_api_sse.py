"""How many streamed answers one `streamvqa api` process holds at once, and on how many Redis connections.

Starts a private redis-server and one `streamvqa api` process (its default settings unless given),
opens --answers concurrent SSE asks (POST /api/streams/ghost/ask) from this process, at most
--open-at-once of them being opened at a time (a realistic arrival, not all in one millisecond),
and plays the worker itself: once every stream is open (or refused) it counts the API's connections to Redis (CLIENT
LIST, this script's own left out), then answers every question with a delta and a final entry,
each stamped with the time it was written. Prints one JSON object:
- answers asked, held at once (questions queued while every stream was open) and completed;
- the API's Redis connections while holding them, and its settings that bound them;
- latency from an entry written to Redis to the client reading it off the SSE stream
  (delta and final, p50/p95/max, ms), and how long opening every stream took.
No model and no GPU: the workers' side is these hand-written entries, so what is measured is
the API alone.

    PYTHONPATH=. python scripts/bench_api_sse.py --answers 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from apps.privateredis import embedded_redis
from common.wire import keys
from common.wire.schemas import FinalAnswer, encode_delta, encode_final

ME = "bench-api-sse"


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "p50_ms": round(at(0.5) * 1000, 2),
        "p95_ms": round(at(0.95) * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def start_api(url: str, port: int, extra: list[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "apps.cli", "api", "--redis-url", url, "--port", str(port), *extra]
    env = os.environ | {"SVQA_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_ready(base: str, api: subprocess.Popen) -> None:
    async with httpx.AsyncClient(base_url=base) as http:
        for _ in range(300):
            if api.poll() is not None:
                raise SystemExit(f"the API exited: {api.stderr.read().decode() if api.stderr else ''}")
            try:
                if (await http.get("/health/ready")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("the API did not become ready in 30 s")


async def ask(http: httpx.AsyncClient, i: int, opening: asyncio.Semaphore, run: Run) -> bool:
    """One streamed answer; at most --open-at-once asks are being opened (not yet answered 200) at a time."""
    await opening.acquire()
    try:
        response = await http.send(
            http.build_request("POST", "/api/streams/ghost/ask", json={"question": f"q{i}"}), stream=True
        )
    finally:
        opening.release()
        run.settled += 1
        if run.settled == run.n:
            run.all_settled.set()
    try:
        if response.status_code != 200:
            run.refused.append(response.status_code)
            return False
        run.opened.append(time.time())
        return await read_answer(response, run.got)
    finally:
        await response.aclose()


async def read_answer(response: httpx.Response, got: dict[str, list[float]]) -> bool:
    """Each event's delay: read now, written at the time its text ends with."""
    event = ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            stamp = data.get("text", "").rsplit(" ", 1)[-1]
            got.setdefault(event, []).append(time.time() - float(stamp))
            if event == "final":
                return True
    return False


@dataclass
class Run:
    n: int
    settled: int = 0  # asks answered 200 or refused
    all_settled: threading.Event = field(default_factory=threading.Event)
    opened: list[float] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    got: dict[str, list[float]] = field(default_factory=dict)
    api_connections: list[int] = field(default_factory=list)


def play_worker(url: str, run: Run) -> None:
    """Once every ask is open (or refused), count the API's connections, then answer every question."""
    r = redis.Redis.from_url(url, client_name=ME)
    run.all_settled.wait(600)
    run.api_connections.append(sum(1 for c in r.client_list() if c["name"] != ME))
    for _, fields in r.xrange(keys.QUESTIONS):
        qid = fields[b"id"].decode()
        r.xadd(keys.answer(qid), encode_delta(f"at {time.time():.6f}"))
        final = FinalAnswer(id=qid, stream="ghost", text=f"at {time.time():.6f}", tokens=1)
        r.xadd(keys.answer(qid), encode_final(final))


async def bench(url: str, ns: argparse.Namespace) -> dict[str, Any]:
    base = f"http://127.0.0.1:{ns.port}"
    api = start_api(url, ns.port, ns.api_args)
    try:
        await wait_ready(base, api)
        redis.Redis.from_url(url).hset(keys.meta("ghost"), mapping={"fps": "2", "height": "56", "width": "56"})
        run = Run(ns.answers)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        opening = asyncio.Semaphore(ns.open_at_once)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=600) as http:
            began = time.time()
            worker = asyncio.create_task(asyncio.to_thread(play_worker, url, run))
            done = await asyncio.gather(*(ask(http, i, opening, run) for i in range(ns.answers)))
            await worker
        return {
            "answers": ns.answers,
            "held_at_once": len(run.opened),
            "refused": len(run.refused),
            "completed": sum(done),
            "api_redis_connections": run.api_connections[0] if run.api_connections else None,
            "open_at_once": ns.open_at_once,
            "api_args": ns.api_args,
            "open_all_s": round(max(run.opened) - began, 2) if run.opened else None,
            "delta_latency": percentiles(run.got.get("delta", [])),
            "final_latency": percentiles(run.got.get("final", [])),
        }
    finally:
        api.terminate()
        api.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", type=int, default=1000, help="concurrent streamed answers")
    parser.add_argument("--open-at-once", type=int, default=64, help="asks being opened at a time")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("api_args", nargs="*", help="more `streamvqa api` flags, after --")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, embedded_redis(Path(tmp)) as url:
        print(json.dumps(asyncio.run(bench(url, ns))))


if __name__ == "__main__":
    main()
