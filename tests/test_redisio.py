"""Redis helpers against a real redis-server: groups, crash recovery, reclaim, restarts."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis

from common.logs import MASK, redact_text, redact_url
from common.redisio import (
    DEAD_LETTER_MAX_FIELDS,
    DEAD_LETTER_MAX_VALUE,
    Attempts,
    GroupReader,
    RedisGone,
    call_riding_out,
    claim_stale,
    connect,
    dead_letter,
    ensure_group,
    keep_alive,
    process,
    prune_consumers,
    reopen_after_future_ids,
    ride_out,
    trim_consumed,
    wait_for_redis,
    xadd_capped,
)
from common.wire import keys
from tests.groupread import read_group
from tests.pipeline import wait_for

S, G = "svqa:{t}:s", "grp"


def _ids(entries) -> list[str]:
    return [eid for _, eid, _ in entries]


def _add(r, n: int, stream: str = S) -> list[str]:
    return [r.xadd(stream, {"i": str(i)}).decode() for i in range(n)]


def test_connect_socket_timeout_above_block(redis_url):
    r = connect(redis_url, block_ms=8000)
    kw = r.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == 13.0 and kw["retry"] is not None and kw["health_check_interval"] > 0
    assert r.ping() and r.set("k", "v") and r.get("k") == b"v"  # bytes: decode_responses=False
    ensure_group(r, S, G)
    with pytest.raises(ValueError, match="socket timeout"):
        read_group(r, [S], G, "c", block_ms=20_000)
    t0 = time.monotonic()
    assert read_group(r, [S], G, "c", block_ms=200) == []  # an empty blocking read just returns
    assert 0.15 < time.monotonic() - t0 < 10  # the upper bound is a hang (the socket timeout, 13 s), not speed


def test_connect_holds_a_blocking_read_per_camera_past_redis_py_default_pool(redis_url):
    """150 threads each in a blocking read on one client (ingest's threads, one per camera): redis-py
    8's default pool of 100 refused the 101st with "Too many connections" (seen at 128 cameras)."""
    r = connect(redis_url, block_ms=2000)
    key = f"t:{time.monotonic_ns()}"
    errors: list[BaseException] = []

    def read() -> None:
        try:
            r.xread({key: "$"}, block=1000)
        except BaseException as e:  # collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_ensure_group_idempotent(redis_url):
    r = connect(redis_url)
    assert ensure_group(r, S, G) is True  # MKSTREAM: the stream exists now
    assert r.exists(S) == 1
    assert ensure_group(r, S, G) is False
    r.set("plain", "x")
    with pytest.raises(redis.ResponseError):
        ensure_group(r, "plain", G)  # only BUSYGROUP is swallowed


def test_read_group_redelivers_after_crash(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    ids = _add(r, 3)
    got = read_group(r, [S], G, "c1", count=10, block_ms=100)
    assert _ids(got) == ids and got[0][0] == S and got[0][2] == {b"i": b"0"}
    r.xack(S, G, ids[0])
    r.close()  # the consumer "crashes" before acking ids[1:]

    r2 = connect(redis_url)
    new = _add(r2, 1)
    again = read_group(r2, [S], G, "c1", count=10, block_ms=100)
    assert _ids(again) == ids[1:]  # its own pending entries first, not the new one
    r2.xack(S, G, *ids[1:])
    assert _ids(read_group(r2, [S], G, "c1", count=10, block_ms=100)) == new
    assert read_group(r2, [S], G, "c2", count=10, block_ms=100) == []  # c2 has nothing pending


def test_read_group_several_streams(redis_url):
    r = connect(redis_url)
    s2 = "svqa:{u}:s"
    for s in (S, s2):
        ensure_group(r, s, G)
    a, b = _add(r, 1)[0], _add(r, 1, s2)[0]
    got = read_group(r, [S, s2], G, "c", block_ms=100)
    assert sorted((s, e) for s, e, _ in got) == sorted([(S, a), (s2, b)])


def _idle(r, consumer: str, ids: list[str], idle_ms: int = 120_000) -> None:
    """``consumer``'s pending ``ids`` made idle for ``idle_ms``, as if it had died that long ago
    (XCLAIM to itself with IDLE and JUSTID: no delivery counted). Sleeping past a min_idle_ms of
    milliseconds instead left the entries claimed just before as idle as that on a slow machine."""
    r.xclaim(S, G, consumer, 0, ids, idle=idle_ms, justid=True)


def test_claim_stale_moves_entries_of_dead_consumer(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    ids = _add(r, 3)
    assert _ids(read_group(r, [S], G, "dead", block_ms=100)) == ids  # never acked: it died
    assert claim_stale(r, S, G, "alive", min_idle_ms=60_000) == []  # not idle long enough yet
    _idle(r, "dead", ids)
    claimed = claim_stale(r, S, G, "alive", min_idle_ms=60_000, count=2)
    assert _ids(claimed) == ids[:2] and claimed[0][2] == {b"i": b"0"}
    claimed += claim_stale(r, S, G, "alive", min_idle_ms=60_000)  # the two just claimed are not idle
    assert _ids(claimed) == ids
    owners = {p["consumer"] for p in r.xpending_range(S, G, "-", "+", 10)}
    assert owners == {b"alive"}
    # The claimed entries are now "alive"'s own pending ones: a restart of it sees them too.
    assert _ids(read_group(r, [S], G, "alive", block_ms=100)) == ids


def test_keep_alive_keeps_own_slow_entries_from_being_claimed_without_counting_deliveries(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    ids = _add(r, 2)
    read_group(r, [S], G, "slow", count=1, block_ms=100)  # ids[0]: being worked on, slowly
    read_group(r, [S], G, "other", count=1, block_ms=100)  # ids[1]: another consumer's
    _idle(r, "slow", ids[:1])
    _idle(r, "other", ids[1:])
    keep_alive(r, S, G, "slow", ids)  # names the other's entry too: it must stay the other's
    assert _ids(claim_stale(r, S, G, "thief", min_idle_ms=60_000)) == [ids[1]]
    pending = {p["message_id"].decode(): p for p in r.xpending_range(S, G, "-", "+", 10)}
    assert pending[ids[0]]["consumer"] == b"slow" and pending[ids[0]]["times_delivered"] == 1


def _dead_letter_rejecter(r):
    def reject(stream, entry_id, fields, reason):
        dead_letter(r, stream, entry_id, fields, reason, group=G)

    return reject


def test_process_rejects_what_raises_and_goes_on(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    _add(r, 3)
    handled = []

    def handle(stream, entry_id, fields, deliveries):
        if fields[b"i"] == b"1":
            raise RecursionError("maximum recursion depth exceeded")
        handled.append((fields[b"i"], deliveries))
        r.xack(stream, G, entry_id)

    process(r, G, "c", read_group(r, [S], G, "c", block_ms=100), handle, _dead_letter_rejecter(r))
    assert handled == [(b"0", 1), (b"2", 1)] and r.xpending(S, G)["pending"] == 0
    ((_, rec),) = r.xrange(keys.DEAD_LETTER)
    assert rec[b"f:i"] == b"1" and rec[b"reason"].startswith(b"RecursionError")


def test_process_rejects_an_entry_that_keeps_killing_its_consumer_unprocessed(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    poison, ok = _add(r, 2)
    read_group(r, [S], G, "c1", block_ms=100)  # delivery 1 of both
    r.xack(S, G, ok)
    handled = []
    for n in range(4):  # each restart claims the dead consumer's entry: one more delivery each time
        got = claim_stale(r, S, G, f"c{n + 2}", min_idle_ms=0)
        process(r, G, f"c{n + 2}", got, lambda *a: handled.append(a[3]), _dead_letter_rejecter(r), max_deliveries=3)
    assert handled == [2, 3], "handled (and 'crashed') twice more, then never again"
    assert r.xpending(S, G)["pending"] == 0  # acked together with the dead-letter entry
    ((_, rec),) = r.xrange(keys.DEAD_LETTER)
    assert rec[b"entry_id"] == poison.encode() and rec[b"f:i"] == b"0" and b"delivered 4" in rec[b"reason"]


def test_process_charges_an_entry_only_for_lives_that_died_handling_it_alone(redis_url):
    """Issue 37.2: a crash charged a delivery to every entry its consumer had read, and innocent
    entries were refused. Now only lives that died handling an entry alone count against it."""
    r = connect(redis_url)
    ensure_group(r, S, G)
    poison, innocent = _add(r, 2)
    handled: list[tuple[str, int]] = []

    def handle(stream, entry_id, fields, attempt):
        if entry_id == poison:
            raise SystemExit  # a death: nothing after it runs, nothing is acked
        handled.append((entry_id, attempt))
        r.xack(stream, G, entry_id)

    def life(entries) -> None:
        attempts = Attempts(r, "c", 60)  # the same consumer name, restarted: a new life
        for entry in entries:  # as the qa service does: a suspect alone
            alone = attempts.suspect(*entry[:2])
            process(
                r, G, "c", [entry], handle, _dead_letter_rejecter(r), max_deliveries=2, attempts=attempts, alone=alone
            )

    for n in range(3):  # each life reads both (XPENDING: one more delivery each) and dies at the poison
        with pytest.raises(SystemExit):
            life(read_group(r, [S], G, "c", block_ms=100) if n == 0 else claim_stale(r, S, G, "c", 0))
    assert handled == [] and r.xpending_range(S, G, "-", "+", 10)[1]["times_delivered"] == 3
    life(claim_stale(r, S, G, "c", 0))
    assert handled == [(innocent, 1)], "delivered 4 times, but only now begun"
    ((_, rec),) = r.xrange(keys.DEAD_LETTER)
    assert rec[b"entry_id"] == poison.encode() and b"under way alone in 2 worker(s) that died" in rec[b"reason"]
    assert r.xpending(S, G)["pending"] == 0 and not r.keys("*attempts*"), "done entries leave no record"


def test_attempts_blame_deaths_alone_and_number_every_attempt(redis_url):
    r = connect(redis_url)
    poison, innocent = _add(r, 2)
    first, second, third = (Attempts(r, "c", 60) for _ in range(3))  # one consumer, restarted twice
    assert first.begin(S, poison, alone=False) == (0, 1) and first.begin(S, innocent, alone=False) == (0, 1)
    assert not first.suspect(S, poison), "its own attempt: no death"
    # the first life died with both under way: each a suspect, neither to blame yet
    assert second.suspect(S, poison) and second.suspect(S, innocent)
    assert second.begin(S, poison, alone=True) == (0, 2)  # and it dies again, alone
    assert third.begin(S, innocent, alone=True) == (0, 2), "the death it shared is not its fault"
    assert third.begin(S, poison, alone=True) == (1, 3)
    assert third.begin(S, poison, alone=True) == (1, 4), "again in one life (an outage): no death, a new number"
    assert 0 < r.ttl(keys.attempts(S, poison)) <= 60
    third.end(S, innocent)
    assert not third.suspect(S, innocent) and not r.exists(keys.attempts(S, innocent))


def test_process_lets_outages_through(redis_server):
    r = connect(redis_server.url, retries=0)
    ensure_group(r, S, G)
    _add(r, 1)
    entries = read_group(r, [S], G, "c", block_ms=100)

    def handle(*_):
        redis_server.stop()
        r.ping()

    with pytest.raises(redis.ConnectionError):
        process(r, G, "c", entries, handle, _dead_letter_rejecter(r))


def test_trim_consumed_keeps_pending_and_undelivered(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    ids = _add(r, 6)
    read_group(r, [S], G, "c", count=4, block_ms=100)
    r.xack(S, G, ids[0], ids[2], ids[3])  # ids[1] still pending, ids[4:] not delivered
    trim_consumed(r, S, G)
    left = [e.decode() for e, _ in r.xrange(S)]
    assert ids[1] in left and left[-2:] == ids[4:]
    for _ in range(40):  # MINID '~' trims whole nodes: many acked entries do go
        r.xack(S, G, *_ids(read_group(r, [S], G, "d", block_ms=100)))  # "c" keeps ids[1]
        _add(r, 10)
    r.xack(S, G, *_ids(read_group(r, [S], G, "d", count=1000, block_ms=100)))
    trim_consumed(r, S, G)
    assert r.xlen(S) > 400, "the oldest pending entry holds everything after it"
    r.xack(S, G, ids[1])
    trim_consumed(r, S, G)
    assert r.xlen(S) < 150


def test_prune_consumers_removes_only_idle_ones_without_pending(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    _add(r, 1)
    read_group(r, [S], G, "holds", block_ms=100)
    read_group(r, [S], G, "idle", block_ms=100)
    read_group(r, [S], G, "me", block_ms=100)
    time.sleep(0.05)
    assert prune_consumers(r, S, G, keep="me", idle_ms=10) == 1
    assert {c["name"] for c in r.xinfo_consumers(S, G)} == {b"holds", b"me"}


def test_ride_out_waits_for_every_redis_a_service_depends_on(redis_url):
    """The encoder reads frames from one Redis and publishes to another: either may be away."""
    from tests.conftest import free_port

    away = connect(f"redis://127.0.0.1:{free_port()}/0", retries=0)
    ride_out([connect(redis_url)], redis.ConnectionError("blip"), grace_s=1.0)  # answers: returns at once
    with pytest.raises(RedisGone):
        ride_out([connect(redis_url), away], redis.ConnectionError("frames gone"), grace_s=0.5)


def test_ride_out_resumes_when_redis_is_back_and_gives_up_after_grace(redis_server):
    r = connect(redis_server.url, retries=0)
    redis_server.stop()
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 1:  # back a second after the first call, which it fails (however late that comes)
            threading.Timer(1.0, redis_server.start).start()
        r.set("k", "v")

    assert call_riding_out(r, step, threading.Event(), grace_s=20) is False and len(calls) == 2
    assert r.get("k") == b"v"
    redis_server.stop()
    t0 = time.monotonic()
    with pytest.raises(RedisGone, match=r"more than 0\.5 s"):
        ride_out(r, redis.ConnectionError("gone"), grace_s=0.5)
    assert time.monotonic() - t0 < 10  # gives up, not waits on: a hang, not speed


def test_group_reader_keeps_pending_without_repeating(redis_url):
    r = connect(redis_url)
    ids = _add(r, 4)
    reader = GroupReader(r, [S], G, "enc-1", count=2, block_ms=100)  # creates the group at "0"
    assert _ids(reader.read()) == ids[:2]
    assert _ids(reader.read()) == ids[2:]  # entries kept un-acked are not returned again
    assert reader.read() == []
    r.xack(S, G, ids[0], ids[1])

    restarted = GroupReader(connect(redis_url), [S], G, "enc-1", count=2, block_ms=100)
    new = _add(r, 1)
    assert _ids(restarted.read()) == ids[2:]  # history first (paged by cursor)
    assert _ids(restarted.read()) == new
    delivered = {p["message_id"].decode(): p["times_delivered"] for p in r.xpending_range(S, G, "-", "+", 10)}
    restarted.reset()  # after an outage: the history again, paged, and no delivery counted for it
    assert _ids(restarted.read()) == [*ids[2:], *new][:2]
    assert _ids(restarted.read()) == [*ids[2:], *new][2:]
    assert {p["message_id"].decode(): p["times_delivered"] for p in r.xpending_range(S, G, "-", "+", 10)} == delivered
    assert restarted.read() == []


def test_group_reader_is_made_without_redis_and_makes_its_groups_at_the_first_read(redis_server):
    """A service builds its readers before its loop rides out outages: building one must not need Redis."""
    r = connect(redis_server.url, retries=0)
    redis_server.stop()
    reader = GroupReader(r, [S], G, "c", block_ms=100)  # Redis away: nothing sent yet
    redis_server.start()
    eid = r.xadd(S, {"i": "0"}).decode()
    assert _ids(reader.read()) == [eid]


def test_group_reader_recreates_vanished_group(redis_url):
    r = connect(redis_url)
    reader = GroupReader(r, [S], G, "c", block_ms=100)
    r.delete(S)  # what a Redis restart without persistence looks like
    assert reader.read() == []
    new = _add(r, 1)
    assert _ids(reader.read()) == new


def test_group_reader_survives_its_stream_deleted_under_a_blocked_read(redis_url):
    """Redis ends a blocked XREADGROUP with UNBLOCKED when the key goes (deleted, or MIGRATEd away
    when a cluster moves its slot): an empty read, and the reader goes on."""
    r = connect(redis_url, block_ms=10_000)
    reader = GroupReader(r, [S], G, "c", block_ms=10_000)

    other = connect(redis_url)
    clients = {c["id"] for c in other.client_list()}  # the reader has not connected yet

    def delete_once_blocked() -> None:  # not after a fixed time: the read may not have begun by then
        wait_for(lambda: _blocked_in(other, "xreadgroup", clients), 30, "the read blocked", poll_s=0.01)
        other.delete(S)

    threading.Thread(target=delete_once_blocked, daemon=True).start()
    t0 = time.monotonic()
    assert reader.read() == [] and time.monotonic() - t0 < 5  # ended by the deletion, not block_ms later
    assert reader.read(block_ms=100) == []  # the group is recreated
    new = _add(r, 1)
    assert _ids(reader.read(block_ms=100)) == new


def _blocked_in(r, command: str, besides: set[str]) -> bool:
    """Whether a client other than ``besides`` (ids) is blocked in ``command``."""
    return any(c["cmd"] == command and "b" in c["flags"] and c["id"] not in besides for c in r.client_list())


def test_trimmed_pending_entries_are_acked_and_skipped(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    ids = _add(r, 3)
    read_group(r, [S], G, "c", block_ms=100)
    r.xtrim(S, maxlen=1, approximate=False)  # MAXLEN trimmed two entries while they were pending
    assert _ids(read_group(r, [S], G, "c", block_ms=100)) == ids[2:]
    assert r.xpending(S, G)["pending"] == 1
    reader = GroupReader(r, [S], G, "c", block_ms=100)
    assert _ids(reader.read()) == ids[2:]


def test_xadd_capped(redis_url):
    r = connect(redis_url)
    for i in range(2000):
        eid = xadd_capped(r, S, {"i": str(i)}, maxlen=100)
    assert isinstance(eid, str)
    assert 100 <= r.xlen(S) < 400  # "~": trimmed in whole macro nodes, never below maxlen


def test_dead_letter_truncates_and_acks_atomically(redis_url):
    r = connect(redis_url)
    ensure_group(r, S, G)
    (eid,) = _add(r, 1)
    read_group(r, [S], G, "c", block_ms=100)
    fields = {b"m": b"\x00" * 600_000, "k": "v", b"n" * 1_000_000: b"1"} | {f"x{i}": "" for i in range(100)}
    dl = dead_letter(r, S, eid, fields, "m: invalid msgpack", group=G)
    assert isinstance(dl, str) and r.xpending(S, G)["pending"] == 0
    ((_, rec),) = r.xrange(keys.DEAD_LETTER)
    assert rec[b"source"] == S.encode() and rec[b"reason"] == b"m: invalid msgpack"
    assert len(rec[b"f:m"]) == DEAD_LETTER_MAX_VALUE and rec[b"f:m:truncated_from"] == b"600000"
    assert rec[b"f:k"] == b"v" and rec[b"f:" + b"n" * 64] == b"1", "a 1 MB field name is cut to 64 bytes"
    assert rec[b"fields_truncated_from"] == b"103" and sum(k.startswith(b"f:x") for k in rec) < DEAD_LETTER_MAX_FIELDS


def test_connect_survives_restart(redis_server):
    r = connect(redis_server.url)
    assert r.set("k", "1")
    redis_server.restart()  # the pooled connection is now dead
    assert r.set("k", "2") and r.get("k") == b"2"

    redis_server.stop()
    t = threading.Timer(0.5, redis_server.start)  # down for a while: backoff must bridge the gap
    t.start()
    try:
        assert r.ping()
    finally:
        t.join()
    assert r.get("k") is None  # a fresh server: no persistence


def test_blocking_read_survives_restart(redis_server):
    r = connect(redis_server.url, block_ms=300)
    reader = GroupReader(r, [S], G, "c", block_ms=300)
    redis_server.restart()
    assert reader.read() == []  # reconnects, finds the group gone, recreates it
    new = _add(r, 1)
    assert _ids(reader.read()) == new


def test_wait_for_redis(redis_url):
    assert wait_for_redis(redis_url, 2).ping()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}.*0.5 s"):
        wait_for_redis(f"redis://:secret@127.0.0.1:{port}/0", 0.5)
    assert time.monotonic() - t0 < 10  # gives up, not waits on: a hang, not speed


def test_redact():
    assert redact_url("redis://:pw@h:6379/0") == f"redis://:{MASK}@h:6379/0"
    assert redact_url("redis://u:pw@h/0") == f"redis://u:{MASK}@h/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    for pw in ("p#w", "p/w", "p?w", "p@w"):  # unescaped: a URL parser ends the userinfo early
        assert redact_url(f"redis://u:{pw}@h:1/0") == f"redis://u:{MASK}@h:1/0"
        assert redact_text(f"bad url 'redis://:{pw}@h:1/0' here") == f"bad url 'redis://:{MASK}@h:1/0' here"


LARGEST_ID = f"{2**64 - 1}-{2**64 - 1}"


def test_a_queue_shut_by_the_largest_id_reopens_once_that_entry_is_done(redis_url):
    """One XADD with the largest id (any user allowed XADD may give it) made every later XADD fail,
    "exhausted the last possible ID": nobody could ask a question until an admin deleted the
    queue. Once the group has read the forged entry and acked it (answered or refused like any
    other), the queue is reopened: later entries are added and delivered, none twice."""
    r = redis.Redis.from_url(redis_url)
    q = "svqa:test:reopen"
    r.delete(q)
    ensure_group(r, q, "g")
    r.xadd(q, {"n": "1"})
    r.xadd(q, {"n": "forged"}, id=LARGEST_ID)
    with pytest.raises(redis.ResponseError, match="exhausted"):
        r.xadd(q, {"n": "2"})
    assert reopen_after_future_ids(r, q) is None  # not read yet: it is answered first, not lost
    read = read_group(r, [q], "g", "c", block_ms=100)
    assert [e[2][b"n"] for e in read] == [b"1", b"forged"]
    assert reopen_after_future_ids(r, q) is None  # read, still pending: being answered
    r.xack(q, "g", *[e[1] for e in read])
    assert reopen_after_future_ids(r, q) == 1
    r.xadd(q, {"n": "2"})
    read = read_group(r, [q], "g", "c", block_ms=100)
    assert [e[2][b"n"] for e in read] == [b"2"]
    r.xack(q, "g", *[e[1] for e in read])
    assert reopen_after_future_ids(r, q) is None  # an open queue is left alone
    r.xadd(q, {"n": "later"}, id=f"{int(time.time() * 1000) + 10 * 86_400_000}-0")  # ten days ahead
    read = read_group(r, [q], "g", "c", block_ms=100)
    assert [e[2][b"n"] for e in read] == [b"later"]
    r.xack(q, "g", *[e[1] for e in read])
    assert reopen_after_future_ids(r, q) == 1
    assert int(r.xadd(q, {"n": "3"}).decode().split("-")[0]) <= time.time() * 1000 + 1  # ids of now again
