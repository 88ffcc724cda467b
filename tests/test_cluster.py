"""Redis Cluster plumbing on a real 3-master cluster: the URL, reads of streams on several slots, the
two-step writes that replace cross-slot transactions, the lease-fenced publish, and a slot moving
under all of them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import pytest
import redis
from redis.cluster import RedisCluster

from common import redisio
from common.config import ConfigError, check_redis_url
from common.logs import MASK, redact_url
from common.wire import keys
from common.wire.schemas import FinalAnswer, encode_final
from encoder_worker.owned_stream import publish_fenced
from tests.conftest import RedisClusterServers
from tests.pipeline import wait_for
from tests.test_schemas import _manifest

G, C = "grp", "c1"
# Three streams whose hash tags put them on three different slots (and, on 3 masters, nodes).
STREAMS = [f"svqa:{{{tag}}}:s" for tag in ("a", "b", "c")]


@pytest.fixture
def rc(redis_cluster: RedisClusterServers) -> redis.Redis:
    return redisio.connect(redis_cluster.url, block_ms=2000)


def _add(r: redis.Redis, stream: str, n: int) -> list[str]:
    return [r.xadd(stream, {"i": str(i)}).decode() for i in range(n)]


def test_cluster_url_selects_the_cluster_client_and_never_shows_its_password(redis_cluster):
    ports = [n.port for n in redis_cluster.nodes]
    r = redisio.wait_for_redis(redis_cluster.url, 5)
    assert isinstance(r, RedisCluster) and len(r.get_primaries()) == 3
    assert {redis_cluster.owner(r.keyslot(s)).port for s in STREAMS} == set(ports)  # one stream per node
    # Any one node is enough to find the others; every key lands on its slot's owner.
    one = redisio.connect(f"redis+cluster://127.0.0.1:{ports[1]}")
    for s in STREAMS:
        one.set(s + ":k", "v")
    assert sorted(k.decode() for k in r.scan_iter(match="svqa:*:k")) == sorted(s + ":k" for s in STREAMS)
    assert redisio.ping_problem(redis_cluster.url, 1.0) is None
    check_redis_url(redis_cluster.url, "redis_url")
    with pytest.raises(ConfigError, match="bad cluster node"):
        check_redis_url("redis+cluster://127.0.0.1:1,:2", "redis_url")
    url = f"redis+cluster://app:hunter2@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/0"
    assert redact_url(url) == f"redis+cluster://app:{MASK}@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/0"
    with pytest.raises(TimeoutError) as e:
        redisio.wait_for_redis("redis+cluster://u:hunter2@127.0.0.1:1,127.0.0.1:2", 0.3)
    assert "hunter2" not in str(e.value) and MASK in str(e.value)
    # A plain URL that names one of its nodes would meet MOVED on most keys: refused at start.
    with pytest.raises(redisio.NotACluster, match=r"redis\+cluster://"):
        redisio.wait_for_redis(redis_cluster.nodes[0].url.removesuffix("/0"), 2)
    status = subprocess.run(
        [sys.executable, "-m", "apps.cli", "status", "--redis-url", redis_cluster.nodes[0].url.removesuffix("/0")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 2 and "redis+cluster://" in status.stderr


def test_group_reader_reads_streams_of_every_slot_without_repeating_pending(rc):
    ids = {s: _add(rc, s, 3) for s in STREAMS}
    reader = redisio.GroupReader(rc, STREAMS, G, C, count=10, block_ms=500)
    got = reader.read()
    assert sorted(e for _, e, _ in got) == sorted(e for v in ids.values() for e in v)
    assert {s for s, _, _ in got} == set(STREAMS)
    t0 = time.monotonic()
    assert reader.read() == []  # kept pending, not returned again; an empty read waits block_ms
    assert 0.4 < time.monotonic() - t0 < 10  # and returns: the upper bound is a hang, not speed
    rc.xack(STREAMS[0], G, *ids[STREAMS[0]])
    # A restarted consumer gets its pending entries first, from every slot...
    again = redisio.GroupReader(rc, STREAMS, G, C, count=10, block_ms=500)
    assert sorted(e for _, e, _ in again.read()) == sorted(ids[STREAMS[1]] + ids[STREAMS[2]])
    # ...then new ones, which end a waiting read early: 0.2 s into a read of 10 s, so that a read
    # that waited out its block_ms fails however slow the machine is.
    later = threading.Timer(0.2, lambda: rc.xadd(STREAMS[2], {"i": "new"}))
    later.start()
    t0 = time.monotonic()
    new = again.read(block_ms=10_000)
    assert [(s, f[b"i"]) for s, _, f in new] == [(STREAMS[2], b"new")] and time.monotonic() - t0 < 5
    # A group that vanished (Redis restarted empty) is recreated on every stream.
    for s in STREAMS:
        rc.delete(s)
    assert again.read() == []
    _add(rc, STREAMS[1], 1)
    assert len(again.read()) == 1


def test_read_streams_tails_streams_of_every_slot(rc):
    cursors = {s: "0-0" for s in STREAMS}
    for s in STREAMS:
        _add(rc, s, 2)
    got = redisio.read_streams(rc, cursors, 10, block_ms=200)
    assert sorted((s, f[b"i"]) for s, _, f in got) == sorted((s, str(i).encode()) for s in STREAMS for i in (0, 1))


def test_dead_letter_is_written_once_and_acks(rc):
    src = STREAMS[0]
    redisio.ensure_group(rc, src, G)
    (eid,) = _add(rc, src, 1)
    [(_, _, fields)] = redisio.GroupReader(rc, [src], G, C, block_ms=100).read()
    first = redisio.dead_letter(rc, src, eid, fields, "bad", group=G)
    # The entry redelivered after a crash between the two steps: acked, not dead-lettered twice.
    assert redisio.dead_letter(rc, src, eid, fields, "bad", group=G) is None and first
    assert rc.xlen(keys.DEAD_LETTER) == 1 and rc.xpending(src, G)["pending"] == 0
    assert rc.keyslot(keys.once(keys.DEAD_LETTER, f"{src}:{eid}")) == rc.keyslot(keys.DEAD_LETTER)
    for stream in (keys.ANSWERS, keys.frames("cam"), keys.QUESTIONS):
        assert rc.keyslot(keys.once(stream, "q1")) == rc.keyslot(stream)


def test_attempts_live_on_their_queues_slot(rc):
    for queue in (keys.QUESTIONS, *(keys.questions(c) for c in ("a", "b", "c"))):  # every master
        assert rc.keyslot(keys.attempts(queue, "1-0")) == rc.keyslot(queue)
        dead, alive = redisio.Attempts(rc, C, 60), redisio.Attempts(rc, C, 60)
        assert dead.begin(queue, "1-0", alone=True) == (0, 1)
        assert alive.suspect(queue, "1-0") and alive.begin(queue, "1-0", alone=True) == (1, 2)
        alive.end(queue, "1-0")
        assert not alive.suspect(queue, "1-0")


def test_publish_is_fenced_by_the_lease_on_its_slot(rc):
    m = _manifest()
    rc.set(keys.lease("cam"), "enc-a")
    assert publish_fenced(rc, "cam", "enc-a", m, 100)
    assert not publish_fenced(rc, "cam", "enc-b", m, 100)  # lost the lease: nothing written
    assert rc.xlen(keys.versions("cam")) == 1 and rc.get(keys.head("cam"))


def test_reads_acks_and_writes_go_on_while_a_slot_moves(rc, redis_cluster):
    """Entries added before, during and after the stream's slot moves are each read once and acked."""
    stream = STREAMS[0]
    reader = redisio.GroupReader(rc, STREAMS, G, C, count=5, block_ms=100)
    added, seen, stop = [], [], threading.Event()

    def produce() -> None:
        while not stop.is_set():
            added.append(rc.xadd(stream, {"i": str(len(added))}).decode())
            time.sleep(0.01)

    def consume() -> None:
        for s, eid, fields in reader.read():
            seen.append(eid)
            rc.xack(s, G, eid)
            redisio.xadd_once(rc, keys.ANSWERS, keys.once(keys.ANSWERS, eid), fields, 1000, 60)

    producer = threading.Thread(target=produce)
    producer.start()
    slot = rc.keyslot(stream)
    before = redis_cluster.owner(slot)
    mover = threading.Thread(target=lambda: redis_cluster.move_slot(slot, batch=2, pause_s=0.1))
    mover.start()
    while mover.is_alive():
        consume()
    time.sleep(0.2)
    stop.set()
    producer.join()
    deadline = time.monotonic() + 10
    while len(seen) < len(added) and time.monotonic() < deadline:
        consume()
    assert redis_cluster.owner(slot) is not before
    assert sorted(seen) == sorted(added) and len(set(seen)) == len(seen)
    assert rc.xpending(stream, G)["pending"] == 0
    assert rc.xlen(keys.ANSWERS) == len(added)


def test_api_sees_streams_on_every_node_and_answers_on_a_cluster(redis_cluster, rc):
    """The HTTP API on a cluster URL: SCAN covers every master, the ask round trip works."""
    from api.app import create_app
    from api.config import ApiConfig

    cams = ["a", "b", "c"]  # the hash tags of STREAMS: one per master
    for cam in cams:
        rc.hset(keys.meta(cam), mapping={"fps": "2", "height": "56", "width": "56", "live": "0"})

    def worker() -> None:  # writes the answer the way a QA worker does
        (_, fields), *_ = wait_for(lambda: rc.xrange(keys.QUESTIONS), 10, "the question")
        qid = fields[b"id"].decode()
        rc.xadd(keys.answer(qid), encode_final(FinalAnswer(id=qid, stream="b", text="Yes.", tokens=1)))

    async def use() -> tuple[dict, int, dict]:
        app = create_app(ApiConfig(redis_url=redis_cluster.url, answer_timeout_s=20))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            streams = (await client.get("/api/streams")).json()
            ready = (await client.get("/health/ready")).status_code
            answer = (await client.post("/api/streams/b/ask", json={"question": "Open?", "stream": False})).json()
        return streams, ready, answer

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    streams, ready, answer = asyncio.run(use())
    thread.join(10)
    assert [s["stream"] for s in streams["streams"]] == cams and ready == 200
    assert answer["text"] == "Yes." and answer["stream"] == "b"


def test_an_outage_of_one_master_is_ridden_out(redis_cluster, rc):
    """ride_out (what every service does on an outage) waits until every master answers again."""
    node = redis_cluster.nodes[1]
    key = next(s for s in STREAMS if redis_cluster.owner(rc.keyslot(s)) is node)
    node.stop()
    assert not redisio._answers(rc)
    with pytest.raises(redisio.OUTAGE_ERRORS):
        redisio.connect(redis_cluster.url, retries=1).xadd(key, {"i": "0"})
    t0 = time.monotonic()  # before the timer: a pause between the two cannot shorten the wait measured
    threading.Timer(0.5, node.start).start()
    redisio.ride_out(rc, redis.ConnectionError("node down"), grace_s=30)
    assert time.monotonic() - t0 >= 0.4 and redisio._answers(rc)
    redis_cluster.wait_ok()
    assert rc.xadd(key, {"i": "1"}) and rc.xlen(key) == 1  # the node came back empty (no persistence)
