"""Every Redis key name streamvqa uses, in one place.

All keys of one camera stream share the hash tag ``{cam}`` so that Redis Cluster keeps them
on one slot (multi-key operations and Lua stay legal there).
"""

PREFIX = "svqa"

QUESTIONS = f"{PREFIX}:questions"
ANSWERS = f"{PREFIX}:answers"
DEAD_LETTER = f"{PREFIX}:deadletter"
# Searches forwarded from QUESTIONS by a QA process without the frames log (qa_worker/routing.py), read
# (group `qa`) only by the processes that have it: their consumers there are how a process knows one is alive.
SEARCHES = f"{PREFIX}:searches"
WORKERS = f"{PREFIX}:workers"  # set of stream-owning worker ids; a worker is live while its `worker` key exists

ENCODER_GROUP = "enc"
QA_GROUP = "qa"
RECORDER_GROUP = "rec"  # `streamvqa recorder`: every camera's frames into the frames log (common/framelog.py)


def stream_of(key: str | bytes) -> str:
    """The camera name inside a per-stream key's hash tag: ``svqa:{cam}:frames`` -> ``cam``."""
    text = key.decode() if isinstance(key, bytes) else key
    return text[text.index("{") + 1 : text.index("}")]


def frames(cam: str) -> str:
    return f"{PREFIX}:{{{cam}}}:frames"


def events(cam: str) -> str:
    return f"{PREFIX}:{{{cam}}}:events"


def versions(cam: str) -> str:
    return f"{PREFIX}:{{{cam}}}:versions"


def head(cam: str) -> str:
    return f"{PREFIX}:{{{cam}}}:head"


def drops(cam: str) -> str:
    """Frames the encoders dropped (not encoded: late, behind the stream's seq), by reason, since the
    stream began: a hash of counts, every worker and every life adding to it."""
    return f"{PREFIX}:{{{cam}}}:drops"


def lease(cam: str) -> str:
    return f"{PREFIX}:{{{cam}}}:lease"


def transcript(cam: str) -> str:
    return f"{PREFIX}:{{{cam}}}:transcript"


def questions(cam: str) -> str:
    """The stream's own question queue: questions forwarded from `QUESTIONS`, read by its owner."""
    return f"{PREFIX}:{{{cam}}}:questions"


def worker(worker_id: str) -> str:
    """A stream-owning worker's heartbeat (hash with a TTL): capacity and the streams it holds."""
    return f"{PREFIX}:worker:{worker_id}"


def once(stream_key: str, ident: str) -> str:
    """Marks that entry ``ident`` was added to ``stream_key`` (``redisio.xadd_once``), on the stream's
    hash slot: a per-stream key keeps its ``{cam}`` tag; a key without one (ANSWERS, DEAD_LETTER)
    becomes the marker's tag, and a key's whole name hashes like a tag of that name."""
    return _beside(stream_key, "once", ident)


def attempts(stream_key: str, entry_id: str) -> str:
    """Which consumer lives began handling entry ``entry_id`` of ``stream_key`` and did not finish
    (``redisio.Attempts``), on the stream's hash slot like ``once``."""
    return _beside(stream_key, "attempts", entry_id)


def _beside(stream_key: str, kind: str, ident: str) -> str:
    if "{" in stream_key:
        return f"{stream_key}:{kind}:{ident}"
    return f"{{{stream_key}}}:{kind}:{ident}"


def answer(qid: str) -> str:
    return f"{PREFIX}:answer:{qid}"


def answer_owner(qid: str) -> str:
    """String with a TTL: the entry id in `QUESTIONS` of the question that holds the id ``qid``
    (the router's claim); another question with that id is not answered into its answer stream.
    Not under ``answer(qid)``'s name: whoever scans for answer streams finds streams only."""
    return f"{PREFIX}:owner:{qid}"


def segment(cam: str, segment_id: str) -> str:
    """Segment bytes when the segment store is Redis (several hosts)."""
    return f"{PREFIX}:{{{cam}}}:seg:{segment_id}"


def meta(cam: str) -> str:
    """Hash written by ingest: fps, height, width (the model grid), live, source url."""
    return f"{PREFIX}:{{{cam}}}:meta"


def job_output(cam: str, job: str) -> str:
    """Answers of a periodic job (caption, custom prompt) on one stream."""
    return f"{PREFIX}:{{{cam}}}:job:{job}"


def latest_frame(cam: str) -> str:
    """Hash written by ingest, overwritten about once a second: `jpeg`, `seq`, `ts` of the newest frame."""
    return f"{PREFIX}:{{{cam}}}:frame:latest"


def alerts(cam: str) -> str:
    """Alerts fired by the stream's alert jobs (capped stream)."""
    return f"{PREFIX}:{{{cam}}}:alerts"


def alerts_armed(cam: str) -> str:
    """Hash: alert job -> id of its newest alert after which its answer turned back to no (the job
    may fire again). What a restarted QA worker's gate resumes from, with the newest alert itself."""
    return f"{PREFIX}:{{{cam}}}:alerts:armed"


def alert_acks(cam: str) -> str:
    """Hash: alert id -> unix time someone acknowledged it (the HTTP API; expires a week after the last)."""
    return f"{PREFIX}:{{{cam}}}:alerts:acked"


def alert_frame(cam: str, alert_id: str) -> str:
    """The latest-frame hash as it was when an alert fired (a copy, with a TTL)."""
    return f"{PREFIX}:{{{cam}}}:alert:{alert_id}:frame"


def features(cam: str) -> str:
    """Each encoded chunk's retrieval vector (capped stream, common/wire/feature_record.py): the encoder
    adds, the recorder indexes it beside the frames log (group `rec`)."""
    return f"{PREFIX}:{{{cam}}}:features"


def admission(cam: str) -> str:
    """Hash: QA consumer -> its queue and answer rate (common/wire/admission.py), for the API's 429."""
    return f"{PREFIX}:{{{cam}}}:admission"
