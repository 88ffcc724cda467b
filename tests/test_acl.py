"""deploy/users.acl.example on a real redis-server: each role can do its job and not another's."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from common import redisio
from common.lease import Lease
from common.placement import Placement
from common.wire import keys
from common.wire.schemas import EndOfStream, encode_delta, encode_frame
from encoder_worker.stream import publish_fenced
from qa_worker.client import Client
from qa_worker.routing import forward, requeue, take_over
from tests.conftest import RedisServer
from tests.test_schemas import _manifest

ACL = Path(__file__).resolve().parent.parent / "deploy" / "users.acl.example"
CAM = "cam1"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path, args=("--aclfile", str(ACL)))
    s.start()
    try:
        yield s
    finally:
        s.stop()


def as_role(server: RedisServer, role: str) -> redis.Redis:
    return redisio.connect(f"redis://{role}:change-me-{role}@127.0.0.1:{server.port}/0", retries=0)


def denied(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except redis.exceptions.NoPermissionError:
        return True
    return False


def ingest_job(r: redis.Redis) -> None:
    r.hset(keys.meta(CAM), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    r.xadd(keys.frames(CAM), encode_frame(EndOfStream(-1)))
    r.xrevrange(keys.frames(CAM), count=10)
    r.xadd(keys.events(CAM), {"type": "connected"})
    r.get(keys.head(CAM))
    r.hset(keys.latest_frame(CAM), mapping={"jpeg": b"\xff\xd8", "seq": 0, "ts": 0.0})
    r.expire(keys.latest_frame(CAM), 60)


def encoder_job(r: redis.Redis) -> None:
    redisio.ensure_group(r, keys.frames(CAM), keys.ENCODER_GROUP)
    reader = redisio.GroupReader(r, [keys.frames(CAM)], keys.ENCODER_GROUP, "enc", block_ms=50)
    entries = reader.read()
    redisio.delivery_counts(r, keys.ENCODER_GROUP, "enc", entries)
    redisio.claim_stale(r, keys.frames(CAM), keys.ENCODER_GROUP, "enc", 0)
    assert Lease(r, CAM, "enc", 5000).acquire()
    assert publish_fenced(r, CAM, "enc", _manifest(stream=CAM), 100)
    r.hgetall(keys.meta(CAM))
    r.set(keys.segment(CAM, "s1"), b"kv")
    redisio.dead_letter(r, keys.frames(CAM), entries[0][1], entries[0][2], "test", group=keys.ENCODER_GROUP)
    redisio.prune_consumers(r, keys.frames(CAM), keys.ENCODER_GROUP, "enc")
    r.xadd(keys.events(CAM), {"type": "encoder_attached"})
    placement = Placement(r, "enc", 4, 5000)  # heartbeat, and the hand-off's look at questions taken
    placement.beat([CAM])
    try:
        r.xpending_range(keys.questions(CAM), keys.QA_GROUP, "-", "+", 1, consumername="enc")
    except redis.ResponseError as e:  # allowed, only no queue yet
        assert "NOGROUP" in str(e)
    placement.leave()


def qa_job(r: redis.Redis) -> None:
    reader = redisio.GroupReader(r, [keys.QUESTIONS], keys.QA_GROUP, "qa", block_ms=50)
    entries = reader.read()
    redisio.claim_stale(r, keys.QUESTIONS, keys.QA_GROUP, "qa", 60_000)
    for _, eid, fields in entries:  # routing: to the stream's queue, taken over, given back
        forward(r, CAM, eid, fields, ttl_s=60)
    reader.add(keys.questions(CAM))
    take_over(r, keys.questions(CAM), "qa")
    for entry in reader.read():
        requeue(r, entry, "qa")
    redisio.trim_consumed(r, keys.questions(CAM), keys.QA_GROUP)
    r.get(keys.head(CAM))
    r.xread({keys.versions(CAM): "0"}, count=1)
    r.get(keys.segment(CAM, "s1"))
    r.delete(keys.answer("q1"))
    r.xadd(keys.answer("q1"), encode_delta("hi"))
    r.expire(keys.answer("q1"), 60)
    redisio.xadd_once(r, keys.ANSWERS, keys.once(keys.ANSWERS, "q1"), {"type": "final", "id": "q1"}, 100, 60)
    redisio.dead_letter(r, keys.QUESTIONS, "0-1", {"x": "y"}, "test")
    r.xadd(keys.transcript(CAM), {"start": "0", "end": "1", "text": "x"})
    r.copy(keys.latest_frame(CAM), keys.alert_frame(CAM, "a1"), replace=True)  # an alert job fired
    r.expire(keys.alert_frame(CAM, "a1"), 60)
    r.xadd(keys.alerts(CAM), {"id": "a1", "frame": keys.alert_frame(CAM, "a1")})
    r.xack(keys.QUESTIONS, keys.QA_GROUP, *(eid for _, eid, _ in entries))
    redisio.trim_consumed(r, keys.QUESTIONS, keys.QA_GROUP)


def recorder_job(r: redis.Redis) -> None:
    """What `streamvqa recorder` does (recorder/service.py): read, claim, ack, gauges, events."""
    reader = redisio.GroupReader(r, [keys.frames(CAM)], keys.RECORDER_GROUP, "recorder", block_ms=50)
    reader.ensure_groups()
    redisio.claim_stale(r, keys.frames(CAM), keys.RECORDER_GROUP, "recorder", 0)
    reader.reset()
    entries = reader.read()
    assert entries
    r.xack(keys.frames(CAM), keys.RECORDER_GROUP, *(eid for _, eid, _ in entries))
    assert r.xinfo_groups(keys.frames(CAM))
    redisio.event(r, CAM, "recorder", "frames_log_collected", reason="space")


def test_each_role_does_its_job_and_not_anothers(server):
    ingest, encoder, qa = (as_role(server, n) for n in ("ingest", "encoder", "qa"))
    client, api, worker = (as_role(server, n) for n in ("client", "api", "worker"))
    recorder = as_role(server, "recorder")
    ingest_job(ingest)
    recorder_job(recorder)
    encoder_job(encoder)
    Client(client).submit(CAM, "what is there?", id="q1")
    qa_job(qa)
    assert [e for _, e in client.xrange(keys.answer("q1"))] and client.xrange(keys.transcript(CAM))
    api.xadd(keys.QUESTIONS, {"stream": CAM, "question": "and now?"})
    assert api.get(keys.head(CAM)) and api.hgetall(keys.meta(CAM)) and api.xinfo_groups(keys.frames(CAM))
    assert api.xrange(keys.events(CAM)) and api.xrange(keys.answer("q1")) and api.xlen(keys.DEAD_LETTER)
    assert api.exists(keys.meta(CAM)) and api.hgetall(keys.latest_frame(CAM)) and api.xrevrange(keys.alerts(CAM))
    assert api.hgetall(keys.alert_frame(CAM, "a1")) and api.pttl(keys.lease(CAM))
    Placement(encoder, "enc", None, 5000).beat([CAM])
    assert api.smembers(keys.WORKERS) == {b"enc"} and api.hgetall(keys.worker("enc"))
    assert api.xinfo_groups(keys.questions(CAM))
    assert api.client_unblock(api.client_id()) == 0  # wakes its own answer readers (api/answers.py)
    ingest_job(ingest)
    Client(client).submit(CAM, "again?", id="q2")  # the worker: encoder and qa roles in one user
    encoder_job(worker)
    qa_job(worker)

    # ... and nothing else
    assert denied(lambda: ingest.set(keys.head(CAM), b"forged"))
    assert denied(lambda: ingest.xadd(keys.QUESTIONS, {"stream": CAM, "question": "x"}))
    assert denied(lambda: ingest.xreadgroup(keys.ENCODER_GROUP, "x", {keys.frames(CAM): ">"}))
    assert denied(lambda: ingest.flushall())
    assert denied(lambda: encoder.xadd(keys.answer("q1"), {"type": "final"}))
    assert denied(lambda: encoder.xadd(keys.frames(CAM), {"m": b"forged"}) and encoder.hset(keys.meta(CAM), "x", 1))
    assert denied(lambda: encoder.config_get("*"))
    assert denied(lambda: worker.hset(keys.meta(CAM), "height", 1))
    assert denied(lambda: qa.set(keys.head(CAM), b"forged"))
    assert denied(lambda: qa.set(keys.lease(CAM), "qa"))
    assert denied(lambda: qa.hset(keys.worker("qa"), "streams", CAM))
    assert denied(lambda: encoder.xadd(keys.questions(CAM), {"stream": CAM, "question": "forged"}))
    assert denied(lambda: client.xadd(keys.questions(CAM), {"stream": CAM, "question": "skips routing"}))
    assert denied(lambda: api.hset(keys.worker("enc"), "streams", ""))
    assert denied(lambda: qa.xadd(keys.frames(CAM), {"m": b"x"}))
    assert denied(lambda: client.xrange(keys.frames(CAM)))
    assert denied(lambda: client.xrange(keys.QUESTIONS))  # others' questions
    assert denied(lambda: client.xadd(f"{keys.PREFIX}:{{{CAM}}}:questions", {"stream": CAM}))  # the workers' queue
    assert denied(lambda: ingest.xadd(f"{keys.PREFIX}:{{{CAM}}}:questions", {"stream": CAM}))
    assert denied(lambda: client.xadd(keys.answer("q1"), {"type": "final", "id": "q1", "text": "forged"}))
    assert denied(lambda: client.get(keys.head(CAM)))
    assert denied(lambda: client.delete(keys.answer("q1")))
    assert denied(lambda: api.xadd(keys.frames(CAM), {"m": b"x"}))
    assert denied(lambda: api.set(keys.head(CAM), b"x"))
    assert denied(lambda: api.xadd(keys.answer("q1"), {"type": "final"}))
    assert denied(lambda: api.xreadgroup(keys.QA_GROUP, "api", {keys.QUESTIONS: ">"}))
    assert denied(lambda: api.xadd(keys.alerts(CAM), {"id": "forged"}))
    assert denied(lambda: qa.hset(keys.latest_frame(CAM), "jpeg", b"forged"))
    assert denied(lambda: recorder.xtrim(keys.frames(CAM), maxlen=0))  # frames are the encoder's too
    assert denied(lambda: recorder.delete(keys.frames(CAM)))
    assert denied(lambda: recorder.get(keys.head(CAM)))
    assert denied(lambda: recorder.xrange(keys.events(CAM)))  # it writes events, reads none
    assert denied(lambda: recorder.xadd(keys.QUESTIONS, {"stream": CAM, "question": "x"}))
    assert denied(lambda: recorder.hset(keys.meta(CAM), "height", 1))
    anonymous = redis.Redis(port=server.port)
    assert anonymous.ping() and denied(lambda: anonymous.get(keys.head(CAM)))


def test_redis_users_script_makes_working_passwords_kept_only_as_hashes(tmp_path: Path):
    """scripts/redis-users.sh: deploy/users.acl with hashes, .env (0600) with the passwords that log in."""
    repo = ACL.parent.parent
    (tmp_path / "deploy").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(ACL, tmp_path / "deploy")
    shutil.copy(repo / ".env.example", tmp_path)
    shutil.copy(repo / "scripts" / "redis-users.sh", tmp_path / "scripts")
    subprocess.run([str(tmp_path / "scripts" / "redis-users.sh")], check=True, capture_output=True, timeout=30)
    env = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines() if "=" in line)
    assert (tmp_path / ".env").stat().st_mode & 0o077 == 0, ".env holds passwords: owner only"
    acl = (tmp_path / "deploy" / "users.acl").read_text()
    server = RedisServer(tmp_path, args=("--aclfile", str(tmp_path / "deploy" / "users.acl")))
    server.start()
    try:
        roles = ("ingest", "encoder", "qa", "worker", "client", "api", "recorder")
        for role in roles:
            password = env[f"STREAMVQA_REDIS_PASSWORD_{role.upper()}"]
            assert len(password) >= 32 and password not in acl
            assert redisio.connect(f"redis://{role}:{password}@127.0.0.1:{server.port}/0", retries=0).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            as_role(server, "qa").ping()  # the example's password is gone
    finally:
        server.stop()
