"""deploy/users.acl.example on a real redis-server: each role can do its job and not another's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from apps.samplevideo import write_sample_video
from common import placement, redisio, stream_status
from common.lease import Lease
from common.placement import Placement
from common.wire import keys
from common.wire.schemas import EndOfStream, encode_delta, encode_frame
from encoder_worker.owned_stream import publish_fenced
from qa_worker.admission import Admission
from qa_worker.client import Client
from qa_worker.jobs import newest_alerts
from qa_worker.routing import forward, forward_search, requeue, searcher_alive, take_over
from tests.conftest import RedisServer
from tests.pipeline import Services, head, wait_for
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
    """Refused by the ACL: the command itself, or a call inside a Lua script (which runs as the caller)."""
    try:
        fn()
    except redis.exceptions.NoPermissionError:
        return True
    except redis.exceptions.ResponseError as e:
        return "can't access" in str(e) or "no permissions" in str(e)
    return False


def ingest_job(r: redis.Redis, cam: str = CAM) -> None:
    r.hset(keys.meta(cam), mapping={"fps": 2, "height": 56, "width": 56, "live": 0})
    r.xadd(keys.frames(cam), encode_frame(EndOfStream(-1)))
    r.xrevrange(keys.frames(cam), count=10)
    r.xadd(keys.events(cam), {"type": "connected"})
    r.get(keys.head(cam))
    r.hset(keys.latest_frame(cam), mapping={"jpeg": b"\xff\xd8", "seq": 0, "ts": 0.0})
    r.expire(keys.latest_frame(cam), 60)


def ingest_denials(r: redis.Redis, cam: str) -> list[bool]:
    """Whatever ingest may do to its own camera, refused on ``cam``: watch, forge, drop its frames."""
    return [
        denied(lambda: r.xadd(keys.frames(cam), encode_frame(EndOfStream(-1)))),
        denied(lambda: r.xrange(keys.frames(cam))),
        denied(lambda: r.expire(keys.frames(cam), 1)),
        denied(lambda: r.hset(keys.meta(cam), "height", 1)),
        denied(lambda: r.get(keys.head(cam))),
        denied(lambda: r.xadd(keys.events(cam), {"type": "forged"})),
    ]


def _del_in_lua(r: redis.Redis, key: str) -> object:
    return r.eval("return redis.call('del', KEYS[1])", 1, key)


def encoder_job(r: redis.Redis) -> None:
    redisio.ensure_group(r, keys.frames(CAM), keys.ENCODER_GROUP)
    reader = redisio.GroupReader(r, [keys.frames(CAM)], keys.ENCODER_GROUP, "enc", block_ms=50)
    entries = reader.read()
    redisio.delivery_counts(r, keys.ENCODER_GROUP, "enc", entries)
    redisio.claim_stale(r, keys.frames(CAM), keys.ENCODER_GROUP, "enc", 0)
    assert Lease(r, CAM, "enc", 5000).acquire()
    assert publish_fenced(r, CAM, "enc", _manifest(stream=CAM), 100)
    r.xrevrange(keys.versions(CAM), count=4)  # a new owner keeps what the newest versions name
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
    attempts = redisio.Attempts(r, "qa", 60)
    for _, eid, fields in entries:  # routing: to the stream's queue, taken over, given back
        attempts.suspect(keys.QUESTIONS, eid)
        attempts.begin(keys.QUESTIONS, eid, alone=True)
        forward(r, CAM, eid, fields, ttl_s=60)
        attempts.end(keys.QUESTIONS, eid)
    reader.add(keys.questions(CAM))
    take_over(r, keys.questions(CAM), "qa")
    for entry in reader.read():
        attempts.suspect(*entry[:2])
        attempts.begin(*entry[:2], alone=False)
        requeue(r, entry, "qa")
    redisio.trim_consumed(r, keys.questions(CAM), keys.QA_GROUP)
    r.get(keys.head(CAM))
    r.xread({keys.versions(CAM): "0"}, count=1)
    r.get(keys.segment(CAM, "s1"))
    r.set(keys.answer_owner("q1"), "0-1", nx=True, ex=60)  # the router claims the question's id
    assert r.get(keys.answer_owner("q1")) == b"0-1"
    r.delete(keys.answer("q1"))
    r.xadd(keys.answer("q1"), encode_delta("hi"))
    r.expire(keys.answer("q1"), 60)
    redisio.xadd_once(r, keys.ANSWERS, keys.once(keys.ANSWERS, "q1"), {"type": "final", "id": "q1"}, 100, 60)
    redisio.dead_letter(r, keys.QUESTIONS, "0-1", {"x": "y"}, "test")
    r.xadd(keys.transcript(CAM), {"start": "0", "end": "1", "text": "x"})
    redisio.event(r, CAM, "qa", "restarted", epoch="e2")  # a mirror or a job saw the stream start over
    r.copy(keys.latest_frame(CAM), keys.alert_frame(CAM, "a1"), replace=True)  # an alert job fired
    r.expire(keys.alert_frame(CAM, "a1"), 60)
    r.xadd(keys.alerts(CAM), {"id": "a1", "frame": keys.alert_frame(CAM, "a1")})
    r.hset(keys.alerts_armed(CAM), "door", "a1")  # its answer turned to no
    newest_alerts(r, CAM, {"door"})  # a restarted job's gate goes on from its newest alert
    r.hgetall(keys.alerts_armed(CAM))
    r.xack(keys.QUESTIONS, keys.QA_GROUP, *(eid for _, eid, _ in entries))
    redisio.trim_consumed(r, keys.QUESTIONS, keys.QA_GROUP)
    searches_job(r, attempts)
    r.hset(keys.admission(CAM), "gone", "garbled")  # a process gone, forgotten when the queue is published
    Admission().publish(r, "qa", [CAM])
    assert list(r.hgetall(keys.admission(CAM))) == [b"qa"]


def searches_job(r: redis.Redis, attempts: redisio.Attempts) -> None:
    """A search forwarded by a process without the frames log (after it looked for a live reader
    of `svqa:searches`), and read, claimed, acked and trimmed there by one with the log."""
    searcher_alive(r)
    qid = uuid.uuid4().hex  # each role's run its own search
    assert forward_search(r, qid, {"id": qid, "search": "a red van"}, ttl_s=60, asked="1-0")
    searches = redisio.GroupReader(r, [keys.SEARCHES], keys.QA_GROUP, "qa", block_ms=50)
    found = searches.read()
    assert [f[b"id"] for _, _, f in found] == [qid.encode()] and searcher_alive(r)
    redisio.claim_stale(r, keys.SEARCHES, keys.QA_GROUP, "qa", 60_000)
    for entry in found:
        attempts.suspect(*entry[:2])
        attempts.begin(*entry[:2], alone=False)
        attempts.end(*entry[:2])
    r.xack(keys.SEARCHES, keys.QA_GROUP, *(eid for _, eid, _ in found))
    redisio.trim_consumed(r, keys.SEARCHES, keys.QA_GROUP)
    redisio.prune_consumers(r, keys.SEARCHES, keys.QA_GROUP, "qa")


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
    assert api.xrevrange(keys.events(CAM)) and api.xread({keys.answer("q1"): "0"}) and api.xlen(keys.DEAD_LETTER)
    assert api.exists(keys.meta(CAM)) and api.hgetall(keys.latest_frame(CAM)) and api.xrevrange(keys.alerts(CAM))
    assert api.hgetall(keys.alert_frame(CAM, "a1")) and api.pttl(keys.lease(CAM))
    Placement(encoder, "enc", None, 5000).beat([CAM])
    assert api.smembers(keys.WORKERS) == {b"enc"} and api.hgetall(keys.worker("enc"))
    assert api.xinfo_groups(keys.questions(CAM))
    assert api.client_unblock(api.client_id()) == 0  # wakes its own answer readers (api/answers.py)
    assert api.hsetnx(keys.alert_acks(CAM), "a1", "1") and api.expire(keys.alert_acks(CAM), 60)  # acknowledges
    assert api.hmget(keys.alert_acks(CAM), ["a1"]) == [b"1"]
    assert api.exists(*stream_status.presence_keys(CAM, failing=True))  # one command, three keys (api/replies.py)
    assert not [r for r in api_status_replies(api) if isinstance(r, redis.exceptions.NoPermissionError)]
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
    assert denied(lambda: client.xadd(keys.SEARCHES, {"search": "skips routing"}))
    assert denied(lambda: api.xadd(keys.SEARCHES, {"search": "skips routing"}))
    assert denied(lambda: encoder.xreadgroup(keys.QA_GROUP, "x", {keys.SEARCHES: ">"}))
    assert denied(lambda: client.xadd(keys.answer("q1"), {"type": "final", "id": "q1", "text": "forged"}))
    assert denied(lambda: client.get(keys.head(CAM)))
    assert denied(lambda: client.delete(keys.answer("q1")))
    assert denied(lambda: api.xadd(keys.frames(CAM), {"m": b"x"}))
    assert denied(lambda: api.set(keys.head(CAM), b"x"))
    assert denied(lambda: api.xadd(keys.answer("q1"), {"type": "final"}))
    assert denied(lambda: api.xreadgroup(keys.QA_GROUP, "api", {keys.QUESTIONS: ">"}))
    assert denied(lambda: api.xadd(keys.alerts(CAM), {"id": "forged"}))
    assert denied(lambda: api.expire(keys.alerts(CAM), 1)) and denied(lambda: api.hsetnx(keys.meta(CAM), "fps", "9"))
    # api: reads what status and the HTTP API show, and nothing more of a stream (its frames, cache,
    # versions, markers), nor the audit streams' contents (dead letters: their count only)
    assert denied(lambda: api.xrange(keys.frames(CAM))) and denied(lambda: api.get(keys.segment(CAM, "s1")))
    assert denied(lambda: api.xrange(keys.versions(CAM))) and denied(lambda: api.xrange(keys.features(CAM)))
    assert denied(lambda: api.get(keys.once(keys.ANSWERS, "q1"))) and denied(lambda: api.xrange(keys.ANSWERS))
    assert denied(lambda: api.xrange(keys.DEAD_LETTER)) and denied(lambda: api.xrange(keys.answer("q1")))
    assert denied(lambda: api.hgetall(keys.alerts_armed(CAM))) and denied(lambda: api.get(keys.answer_owner("q1")))
    assert denied(lambda: api.hgetall(keys.attempts(keys.questions(CAM), "0-1")))
    assert denied(lambda: api.xrange(keys.QUESTIONS)) and denied(lambda: api.expire(keys.meta(CAM), 1))
    assert denied(lambda: qa.hset(keys.latest_frame(CAM), "jpeg", b"forged"))
    assert denied(lambda: recorder.xtrim(keys.frames(CAM), maxlen=0))  # frames are the encoder's too
    assert denied(lambda: recorder.delete(keys.frames(CAM)))
    assert denied(lambda: recorder.get(keys.head(CAM)))
    assert denied(lambda: recorder.xrange(keys.events(CAM)))  # it writes events, reads none
    assert denied(lambda: recorder.xadd(keys.QUESTIONS, {"stream": CAM, "question": "x"}))
    assert denied(lambda: recorder.hset(keys.meta(CAM), "height", 1))
    assert denied(lambda: recorder.xadd(keys.frames(CAM), {"m": b"forged"}))
    assert denied(lambda: ingest.expire(keys.frames(CAM), 1)) and denied(lambda: ingest.hset(keys.frames(CAM), "x", 1))
    # encoder, worker: DEL only leases (the owner-checked release) and heartbeats; SET only what they write
    for role in (encoder, worker):
        assert denied(lambda r=role: r.delete(keys.head(CAM))) and denied(lambda r=role: r.delete(keys.versions(CAM)))
        assert denied(lambda r=role: r.unlink(keys.head(CAM))) and denied(lambda r=role: r.delete(keys.frames(CAM)))
        assert denied(lambda r=role: r.set(keys.meta(CAM), b"x")) and denied(lambda r=role: r.set(keys.worker("x"), 1))
        assert denied(lambda r=role: r.set(keys.versions(CAM), b"x"))
        assert denied(lambda r=role: r.pexpire(keys.head(CAM), 1))
        assert denied(lambda r=role: _del_in_lua(r, keys.head(CAM)))  # scripts run with the caller's ACL
        assert denied(lambda r=role: r.delete(keys.segment(CAM, "s1")))  # segments: UNLINK by their gc only
    # commands no code of the role runs on those keys: claims other than XAUTOCLAIM, scripts on frames,
    # reading back answer streams and job outputs, the recorder pruning the features' consumers
    for role in (encoder, worker, recorder):
        assert denied(lambda r=role: r.xclaim(keys.frames(CAM), keys.ENCODER_GROUP, "x", 0, ["0-1"]))
    assert denied(lambda: recorder.xclaim(keys.features(CAM), keys.RECORDER_GROUP, "x", 0, ["0-1"]))
    assert denied(lambda: recorder.xgroup_delconsumer(keys.features(CAM), keys.RECORDER_GROUP, "x"))
    assert denied(lambda: encoder.eval("return 1", 1, keys.frames(CAM))) and denied(
        lambda: encoder.exists(keys.lease(CAM))
    )
    for role in (qa, worker):
        assert denied(lambda r=role: r.xrange(keys.answer("q1"))) and denied(
            lambda r=role: r.xread({keys.answer("q1"): "0"})
        )
        assert denied(lambda r=role: r.xrange(keys.job_output(CAM, "captions")))
        assert denied(lambda r=role: r.xrange(keys.versions(CAM)))
    # qa, worker: the audit streams take XADD only (directly or from a script), never DEL, XTRIM, SET
    for role in (qa, worker):
        for audit in (keys.ANSWERS, keys.DEAD_LETTER):
            assert denied(lambda r=role, k=audit: r.delete(k)) and denied(lambda r=role, k=audit: r.xtrim(k, maxlen=0))
            assert denied(lambda r=role, k=audit: r.set(k, b"x")) and denied(lambda r=role, k=audit: _del_in_lua(r, k))
            assert denied(lambda r=role, k=audit: r.xdel(k, "0-1")) and denied(lambda r=role, k=audit: r.unlink(k))
        assert denied(lambda r=role: r.delete(keys.QUESTIONS)) and denied(lambda r=role: r.delete(keys.transcript(CAM)))
    # client: answers only by name; their names are random
    assert denied(lambda: client.scan()) and denied(lambda: client.keys("svqa:answer:*"))
    assert denied(lambda: client.xread({keys.ANSWERS: "0"}))
    qid = Client(client).submit(CAM, "whose answer?")
    (entry_id,) = [eid.decode() for eid, f in qa.xrange(keys.QUESTIONS) if f.get(b"id") == qid.encode()]
    assert entry_id != qid and len(qid) >= 22
    anonymous = redis.Redis(port=server.port)
    assert anonymous.ping() and denied(lambda: anonymous.get(keys.head(CAM)))


def api_status_replies(api: redis.Redis) -> list[object]:
    """What `streamvqa status` and the HTTP API's stream listing read, replies as they come (a refused
    command is one of them: the pipelines run with ``raise_on_error=False``)."""
    names = stream_status.stream_names(k for p in stream_status.STREAM_PATTERNS for k in api.scan_iter(p))
    assert CAM in names
    pipe = api.pipeline(transaction=False)
    stream_status.queue_all(pipe, names)
    stream_status.queue_frames(pipe, names)
    replies = pipe.execute(raise_on_error=False)
    pipe = api.pipeline(transaction=False)
    placement.queue_workers(pipe, placement.worker_ids(api.smembers(keys.WORKERS)))
    return replies + pipe.execute(raise_on_error=False)


def generate_users(tmp_path: Path, cameras: tuple[str, ...] = ()) -> tuple[Path, dict[str, str]]:
    """scripts/redis-users.sh run on a copy of the repository's files (with a cameras file naming
    ``cameras``, if any): the users file it wrote and the passwords it put in .env."""
    repo = ACL.parent.parent
    (tmp_path / "deploy").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(ACL, tmp_path / "deploy")
    shutil.copy(repo / "deploy" / "ingest-camera.acl.template", tmp_path / "deploy")
    shutil.copy(repo / ".env.example", tmp_path)
    shutil.copy(repo / "scripts" / "redis-users.sh", tmp_path / "scripts")
    args = []
    if cameras:
        listed = "".join(f"  - name: {c}\n    url: rtsp://cam.local/{c}\n    fps: 2\n" for c in cameras)
        jobs = "jobs:\n  - name: captions\n    stream: '*'\n    kind: caption\n    every_s: 10\n"
        (tmp_path / "cams.yaml").write_text(f"# cameras\ncameras:\n{listed}\n{jobs}")
        args = [str(tmp_path / "cams.yaml")]
    subprocess.run([str(tmp_path / "scripts" / "redis-users.sh"), *args], check=True, capture_output=True, timeout=30)
    env = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines() if "=" in line)
    return tmp_path / "deploy" / "users.acl", env


def login(server: RedisServer, user: str, env: dict[str, str]) -> redis.Redis:
    password = env["STREAMVQA_REDIS_PASSWORD_" + user.upper().replace("-", "_").replace(".", "_")]
    return redisio.connect(f"redis://{user}:{password}@127.0.0.1:{server.port}/0", retries=0)


def test_redis_users_script_makes_working_passwords_kept_only_as_hashes(tmp_path: Path):
    """scripts/redis-users.sh: deploy/users.acl with hashes, .env (0600) with the passwords that log in."""
    users, env = generate_users(tmp_path)
    assert (tmp_path / ".env").stat().st_mode & 0o077 == 0, ".env holds passwords: owner only"
    acl = users.read_text()
    server = RedisServer(tmp_path, args=("--aclfile", str(users)))
    server.start()
    try:
        roles = ("ingest", "encoder", "qa", "worker", "client", "api", "recorder")
        for role in roles:
            password = env[f"STREAMVQA_REDIS_PASSWORD_{role.upper()}"]
            assert len(password) >= 32 and password not in acl
            assert login(server, role, env).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            as_role(server, "qa").ping()  # the example's password is gone
    finally:
        server.stop()


def test_ingest_users_from_the_cameras_file_touch_their_cameras_only(tmp_path: Path):
    """With a cameras file: `ingest-<cam>` may touch its camera's keys only, the shared `ingest` only
    the cameras named there."""
    users, env = generate_users(tmp_path, ("cam1", "cam.2"))
    assert "ingest-captions" not in users.read_text(), "a job is no camera"
    server = RedisServer(tmp_path, args=("--aclfile", str(users)))
    server.start()
    try:
        one, two, shared = (login(server, u, env) for u in ("ingest-cam1", "ingest-cam.2", "ingest"))
        ingest_job(one, "cam1")
        ingest_job(two, "cam.2")
        assert all(ingest_denials(one, "cam.2")) and all(ingest_denials(two, "cam1"))
        assert all(ingest_denials(one, "cam3")) and denied(lambda: one.xadd(keys.QUESTIONS, {"x": "y"}))
        ingest_job(shared, "cam1")
        ingest_job(shared, "cam.2")
        assert all(ingest_denials(shared, "cam3")), "the shared ingest user: only the cameras in the file"
    finally:
        server.stop()


def test_the_services_work_under_their_roles(tmp_path: Path):
    """Real processes, each logged in as its role (ingest as its camera's user, segments in Redis):
    a file is encoded and a client's question answered; then `streamvqa worker` takes the stream
    over and answers again. Nothing is refused on the way."""
    users, env = generate_users(tmp_path, (CAM,))
    server = RedisServer(tmp_path, args=("--aclfile", str(users)))
    server.start()

    def url(user: str) -> dict[str, str]:
        password = env["STREAMVQA_REDIS_PASSWORD_" + user.upper().replace("-", "_")]
        return {"SVQA_REDIS_URL": f"redis://{user}:{password}@127.0.0.1:{server.port}/0"}

    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=3, fps=10, width=160, height=120)
    services = Services(server.url, tmp_path, SVQA_STREAMS=CAM, SVQA_SEGMENT_STORE="redis://", SVQA_LEASE_MS="2000")
    client, qa = Client(login(server, "client", env)), login(server, "qa", env)
    try:
        encoder = services.start("encoder", **url("encoder"))
        split = [encoder, services.start("qa", **url("qa"))]
        ingest = services.start("ingest", "--url", video, "--stream", CAM, "--fps", "2", **url(f"ingest-{CAM}"))
        assert ingest.wait(timeout=120) == 0, services.logs()
        wait_for(lambda: (h := head(qa, CAM)) and h.last_frame_seq == 5, 120, "all 6 frames encoded", services)
        assert client.ask(CAM, "What is there?", max_tokens=2, timeout_s=120).error is None, services.logs()
        for p in split:
            p.terminate()
            p.wait(timeout=30)
        services.start("worker", **url("worker"))
        answered = client.ask(CAM, "And now?", max_tokens=2, timeout_s=120)
        assert answered.error is None and answered.version == head(qa, CAM).version, services.logs()
        assert "NOPERM" not in services.logs() and "no permissions" not in services.logs()
    finally:
        services.stop_all()
        server.stop()


def test_status_runs_as_the_api_user_and_says_so_in_one_line_as_another(server):
    """README's compose commands ran `status` as the worker's user; as `client` (the user README
    gives the host) it ended in a traceback, exit 1. The api user may read what status shows."""
    ingest_job(as_role(server, "ingest"))

    def status(role: str) -> subprocess.CompletedProcess[str]:
        url = f"redis://{role}:change-me-{role}@127.0.0.1:{server.port}/0"
        cmd = [sys.executable, "-m", "apps.cli", "status", "--redis-url", url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    shown = status("api")
    assert shown.returncode == 0 and CAM in shown.stdout and "no permissions" not in shown.stdout, shown
    refused = status("client")
    assert refused.returncode == 3 and "Traceback" not in refused.stderr, refused
    (line,) = [json.loads(x) for x in refused.stderr.splitlines() if x.startswith("{")]
    assert line["event"] == "redis refused" and "api" in line["hint"] and "change-me" not in refused.stderr


def test_the_qa_role_reopens_a_queue_the_largest_id_shut_and_a_client_cannot_tamper(server):
    """A client may XADD any id: the largest shut the questions queue for everyone. The qa role may
    reopen it once the forged entry is done (redisio.reopen_after_future_ids); a client may not
    delete entries or move the queue's ids."""
    qa, client = as_role(server, "qa"), as_role(server, "client")
    redisio.ensure_group(qa, keys.QUESTIONS, keys.QA_GROUP)
    client.xadd(keys.QUESTIONS, {"q": "forged"}, id=f"{2**64 - 1}-{2**64 - 1}")
    read = qa.xreadgroup(keys.QA_GROUP, "qa-1", {keys.QUESTIONS: ">"})
    qa.xack(keys.QUESTIONS, keys.QA_GROUP, read[0][1][0][0])
    assert denied(lambda: client.xdel(keys.QUESTIONS, f"{2**64 - 1}-{2**64 - 1}"))
    assert denied(lambda: client.execute_command("XSETID", keys.QUESTIONS, "1-0"))
    assert denied(lambda: redisio.reopen_after_future_ids(client, keys.QUESTIONS))
    assert redisio.reopen_after_future_ids(qa, keys.QUESTIONS) == 1
    client.xadd(keys.QUESTIONS, {"q": "asked"})
    assert [f for _, f in qa.xreadgroup(keys.QA_GROUP, "qa-1", {keys.QUESTIONS: ">"})[0][1]] == [{b"q": b"asked"}]
