"""What the workers wrote, read back: stream status, events, latest frame, transcript, job outputs, alerts."""

from __future__ import annotations

import time
from typing import Literal

import redis.asyncio as aredis
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse, Response

from api import clips, errors, replies
from api.guard import require_token
from common import placement, redisio, stream_status
from common.wire import keys
from common.wire.alert_record import alert_payload
from common.wire.schemas import INT64_MAX
from common.wire.transcript import by_start, cues_of, entry_json, output_json, render_transcript

router = APIRouter(prefix="/api", tags=["streams"], dependencies=[Depends(require_token)])

Count = Query(50, ge=1, le=1000, description="newest entries to return")
ACKS_TTL_S = 7 * 86_400  # acknowledgements outlive their alerts' frames (alert_frame_ttl_s, 7 days by default)
SUBTITLE_TYPES = {"vtt": "text/vtt; charset=utf-8", "srt": "application/x-subrip; charset=utf-8"}


def entries(raw: list) -> list[dict[str, str]]:
    """XREVRANGE replies (newest first) -> dicts with their entry `id`, oldest first."""
    return [{"id": redisio.text(i)} | redisio.text_fields(f) for i, f in reversed(raw)]


def alerts_of(raw: list) -> list[dict]:
    """XREVRANGE replies of an alerts stream -> alerts as the webhook and MQTT send them, oldest first."""
    return [alert_payload(redisio.text_fields(f)) for _, f in reversed(raw)]


async def stream_names(r: aredis.Redis) -> list[str]:
    return stream_status.stream_names([k for p in stream_status.STREAM_PATTERNS async for k in r.scan_iter(p)])


async def collect(request: Request, names: list[str]) -> dict:
    r, frames = request.app.state.r, request.app.state.frames
    pipe = r.pipeline(transaction=False)
    stream_status.queue_all(pipe, names)
    found = stream_status.all_from(names, await pipe.execute(raise_on_error=False), time.time())
    found["workers"] = await workers(r, found)
    if frames is r:
        return found
    pipe = frames.pipeline(transaction=False)
    stream_status.queue_frames(pipe, names)
    return stream_status.frames_from(found, await pipe.execute(raise_on_error=False))


async def workers(r: aredis.Redis, found: dict) -> list[dict]:
    """Live workers, each with the streams ``found``'s leases name it the holder of."""
    ids, pipe = placement.worker_ids(await r.smembers(keys.WORKERS)), r.pipeline(transaction=False)
    placement.queue_workers(pipe, ids)
    return stream_status.workers_from(ids, await pipe.execute(raise_on_error=False), found["streams"], found["at"])


@router.get("/streams", summary="Every stream with its status, the workers holding them, and the question queue")
async def list_streams(request: Request) -> dict:
    return await collect(request, await stream_names(request.app.state.r))


@router.get("/streams/{name}", summary="One stream's status")
async def one_stream(name: str, request: Request) -> dict:
    r = request.app.state.r
    found = await collect(request, [await replies.known_stream(r, name, failing=True)])
    return found["streams"][0]


@router.get("/streams/{name}/events", summary="The stream's recent events (ingest and encoder)")
async def events(name: str, request: Request, count: int = Count) -> dict:
    r = request.app.state.r
    key = keys.events(await replies.known_stream(r, name, failing=True))
    return {"events": entries(await r.xrevrange(key, count=count))}


async def _jpeg(r: aredis.Redis, key: str, what: str) -> Response:
    frame = await r.hgetall(key)
    if b"jpeg" not in frame:
        raise errors.ApiError(404, f"no {what}")
    seq, ts = redisio.text(frame[b"seq"]), redisio.text(frame[b"ts"])
    headers = {"Cache-Control": "no-store", "X-Frame-Seq": seq, "X-Frame-Ts": ts}
    return Response(frame[b"jpeg"], media_type="image/jpeg", headers=headers)


@router.get("/streams/{name}/frame.jpg", summary="The newest frame (JPEG, refreshed about once a second)")
async def latest_frame(name: str, request: Request) -> Response:
    return await _jpeg(request.app.state.frames, keys.latest_frame(replies.stream_name(name)), "frame yet")


@router.get("/streams/{name}/transcript", summary="On-screen text transcribed by subtitle jobs")
async def transcript(
    name: str,
    request: Request,
    format: Literal["json", "vtt", "srt"] = "json",
    count: int = Query(10_000, ge=1, le=INT64_MAX),  # past what Redis takes, XREVRANGE COUNT fails (a 500)
):
    r = request.app.state.r
    found = entries(await r.xrevrange(keys.transcript(await replies.known_stream(r, name)), count=count))
    if format == "json":
        return {"stream": name, "cues": [entry_json(e) for e in by_start(found)]}
    return PlainTextResponse(render_transcript(cues_of(found), format), media_type=SUBTITLE_TYPES[format])


@router.get("/streams/{name}/jobs", summary="Names of the stream's caption/custom jobs that wrote outputs")
async def jobs(name: str, request: Request) -> dict:
    r = request.app.state.r
    prefix = keys.job_output(await replies.known_stream(r, name), "")
    found = sorted({redisio.text(k)[len(prefix) :] async for k in r.scan_iter(prefix + "*")})
    return {"stream": name, "jobs": found}


@router.get("/streams/{name}/jobs/{job}", summary="A caption/custom job's outputs")
async def job_outputs(name: str, job: str, request: Request, count: int = Count) -> dict:
    r = request.app.state.r
    key = keys.job_output(await replies.known_stream(r, name), replies.stream_name(job, "job"))
    found = await r.xrevrange(key, count=count)
    # a job that never wrote here (a typo, another stream's job) is not found, as `jobs` lists it not
    if not found and not await r.exists(key):
        raise errors.ApiError(404, f"stream {name!r} has no outputs of job {job!r}", param="job", code="job_not_found")
    return {"stream": name, "job": job, "outputs": [output_json(e) for e in entries(found)]}


async def stream_alerts_of(request: Request, name: str, count: int) -> list[dict]:
    """The stream's newest ``count`` alerts, oldest first, each with ``acked``: when someone
    acknowledged it (unix time), or None; and its ``evidence`` (api/clips.py) where this API reads
    a frames log."""
    r = request.app.state.r
    found = alerts_of(await r.xrevrange(keys.alerts(name), count=count))
    acked = await r.hmget(keys.alert_acks(name), [a["id"] for a in found]) if found else []
    out = [a | {"acked": float(t) if t is not None else None} for a, t in zip(found, acked, strict=True)]
    if request.app.state.cfg.framelog_dir is None:
        return out
    return [a | {"evidence": clips.evidence(name, [(a["t_start"], a["t_end"])])} for a in out]


@router.get("/streams/{name}/alerts", summary="The stream's recent alerts")
async def stream_alerts(name: str, request: Request, count: int = Count) -> dict:
    r = request.app.state.r
    return {"alerts": await stream_alerts_of(request, await replies.known_stream(r, name), count)}


@router.get("/alerts", summary="Recent alerts of every stream, newest last")
async def all_alerts(request: Request, count: int = Count) -> dict:
    r = request.app.state.r
    found = [a for n in await stream_names(r) for a in await stream_alerts_of(request, n, count)]
    return {"alerts": sorted(found, key=lambda a: a["at"])[-count:]}


@router.post("/streams/{name}/alerts/{alert_id}/ack", summary="Acknowledge an alert (seen, handled)")
async def ack_alert(name: str, alert_id: str, request: Request) -> dict:
    r = request.app.state.r
    key = keys.alert_acks(await replies.known_stream(r, name))
    alert_id = replies.stream_name(alert_id, "alert_id")
    if not any(redisio.text(f.get(b"id", b"")) == alert_id for _, f in await r.xrevrange(keys.alerts(name))):
        raise errors.ApiError(404, f"no alert {alert_id!r} on stream {name!r}", param="alert_id")
    now = time.time()
    pipe = r.pipeline(transaction=False)
    pipe.hsetnx(key, alert_id, repr(now))  # the first acknowledgement stands
    pipe.hget(key, alert_id)
    pipe.expire(key, ACKS_TTL_S)
    _, acked, _ = await pipe.execute()
    return {"stream": name, "id": alert_id, "acked": float(acked)}


@router.get("/streams/{name}/alerts/{alert_id}/frame.jpg", summary="The frame an alert fired on")
async def alert_frame(name: str, alert_id: str, request: Request) -> Response:
    key = keys.alert_frame(replies.stream_name(name), replies.stream_name(alert_id, "alert_id"))
    return await _jpeg(request.app.state.frames, key, "frame for this alert")
