"""Alerts: when a yes becomes an alert (debounce, cooldown, edge), the job wiring to Redis, and
delivery to a real webhook receiver (that fails before it accepts) and a real mosquitto broker."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence

import numpy as np
import pytest
import redis

from common import metrics
from common.config import ConfigError, Job
from common.engine.grid import StreamSpec, choose_grid
from common.engine.model import load_model
from common.engine.runtime import Runtime
from common.engine.stream_engine import StreamEngine
from common.wire import keys
from common.wire.alert_record import Alert, alert_payload, frame_path
from qa_worker.alerts import AlertSettings, Delivery, Gate, Retry, p_yes
from qa_worker.jobs import JobRunner
from tests.alerting import broker, webhook

FAST = Retry(attempts=4, backoff_s=0.05, backoff_max_s=0.2, timeout_s=2.0)


def alert(n: int = 0) -> Alert:
    return Alert(Alert.new_id(), "cam1", "door", "Is the door open?", 0.9, 0.5, n, 0.0, 2.0, time.time(), None)


def deliveries(target: str, outcome: str) -> float:
    """svqa_alert_deliveries_total of cam1 as /metrics would show it now."""
    return metrics.ALERT_DELIVERIES.labels("cam1", target, outcome)._value.get()


def test_p_yes_is_a_two_way_softmax_of_the_option_scores():
    assert p_yes([-1.0, -1.0]) == pytest.approx(0.5)
    assert p_yes([0.0, -2.0]) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert p_yes([-1e9, 0.0]) < 1e-300 and p_yes([0.0, -1e9]) == 1.0  # no overflow


def test_gate_debounces_fires_once_per_turn_to_yes_and_keeps_the_cooldown():
    gate = Gate(debounce=2, cooldown_s=10.0)
    fired = [gate.observe(yes, t) for t, yes in enumerate([True, False, True, True, True, False, True, True])]
    # one yes then no: not debounced; two in a row: fires; still yes: quiet; no, yes, yes: within cooldown
    assert fired == [False, False, False, True, False, False, False, False]
    assert gate.observe(True, 13.0), "cooldown over and the answer turned to yes again since: fires"
    assert not gate.observe(True, 30.0), "still the same yes: no second alert"


def test_alert_jobs_are_validated():
    ok = Job(name="a", stream="cam1", kind="alert", prompt="Door open?", every_s=2, mqtt="mqtt://u:pw@host/t/x")
    assert ok.threshold == 0.5 and ok.debounce == 1
    bad = [
        {"prompt": None},
        {"threshold": 1.5},
        {"debounce": 0},
        {"cooldown_s": -1},
        {"webhook": "ftp://host/x"},
        {"mqtt": "mqtt://u:pw@host"},  # no topic
    ]
    for override in bad:
        kw = {"name": "a", "stream": "cam1", "kind": "alert", "prompt": "Door open?", "every_s": 2} | override
        with pytest.raises(ConfigError) as e:
            Job(**kw)
        assert "pw" not in str(e.value), "a password in a URL never reaches an error message"
    with pytest.raises(ConfigError, match="only alert jobs"):
        Job(name="c", stream="cam1", kind="caption", every_s=2, webhook="http://host/x")


def test_webhook_that_fails_twice_gets_the_same_alert_three_times(tmp_path):
    with webhook(fail_first=2) as hook:
        delivery = Delivery(FAST)
        a = alert()
        before = deliveries("webhook", "delivered"), deliveries("webhook", "failed")
        delivery.submit(a, {"webhook": hook.url, "mqtt": None})
        delivery.close(timeout_s=10)
    # the retries are one delivery: counted once, delivered
    assert (deliveries("webhook", "delivered"), deliveries("webhook", "failed")) == (before[0] + 1, before[1])
    assert [body["id"] for _, body in hook.requests] == [a.id] * 3
    assert [h["Idempotency-Key"] for h, _ in hook.requests] == [a.id] * 3
    assert hook.accepted == [a.payload()]


def test_a_dead_receiver_gives_up_after_the_attempts_and_never_blocks_submit(tmp_path):
    with webhook(fail_first=100) as hook:
        delivery = Delivery(FAST)
        failed = deliveries("webhook", "failed")
        hook.answering.clear()  # the receiver holds every POST: a submit that sent one would wait
        t0 = time.monotonic()
        for n in range(3):
            delivery.submit(alert(n), {"webhook": hook.url, "mqtt": None})
        # Queueing takes microseconds; a submit that posted would have waited out the held POST's
        # timeout (and its retries'): a bound that far off holds on any machine, however loaded.
        assert time.monotonic() - t0 < FAST.timeout_s, "submit only queues"
        hook.answering.set()
        delivery.close(timeout_s=10)
    assert len(hook.requests) == 3 * FAST.attempts and not hook.accepted
    assert deliveries("webhook", "failed") == failed + 3


def test_a_receiver_answering_no_http_or_a_url_with_a_space_fails_that_delivery_alone_and_no_secret_is_logged():
    """A bad status line (http.client's BadStatusLine) and a URL with a space (its InvalidURL, which
    quotes the path and query) are no OSError: each escaped and ended the delivery thread, with the
    token in its traceback, and every later alert was queued for nobody. Now each fails its own
    delivery, said without the URL's secrets, and the next alert is delivered."""
    import socket
    import threading

    from structlog.testing import capture_logs

    from tests.conftest import free_port

    listening = socket.create_server(("127.0.0.1", free_port()))

    def answer_no_http() -> None:
        while True:
            try:
                conn, _ = listening.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 abc OK\r\n\r\n")

    threading.Thread(target=answer_no_http, daemon=True).start()
    hostile = f"http://127.0.0.1:{listening.getsockname()[1]}/hook?token=s3cr3t"
    with webhook() as hook, capture_logs() as logs:
        delivery = Delivery(FAST)
        failed = deliveries("webhook", "failed")
        delivery.submit(alert(1), {"webhook": hostile, "mqtt": None})
        delivery.submit(alert(2), {"webhook": f"http://127.0.0.1:{hook.server.server_port}/hook?token=s3 cr3t"})
        after = alert(3)
        delivery.submit(after, {"webhook": hook.url, "mqtt": None})
        delivery.close(timeout_s=20)
    listening.close()
    assert hook.accepted == [after.payload()], "the alert after them was delivered"
    assert deliveries("webhook", "failed") == failed + 2
    errors = [e["error"] for e in logs if e["event"] == "alert delivery failed"]
    assert len(errors) == 2 * FAST.attempts and any("abc" in e for e in errors), errors
    assert not any("s3" in str(e) or "cr3t" in str(e) for e in logs), logs


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_a_broker_refusing_the_client_fails_each_attempt_at_once_saying_so(tmp_path):
    """mosquitto refusing the client's credentials: the first attempt waited out its timeout as
    "did not acknowledge", and the next one's publish raised paho's RuntimeError (not connected),
    which no retry caught: it ended the delivery thread. Now every attempt fails at once with the
    broker's reason, and the alert is counted failed; the password is in no log line."""
    import subprocess

    from structlog.testing import capture_logs

    from tests.alerting import MOSQUITTO
    from tests.conftest import free_port

    port = free_port()
    (tmp_path / "mosquitto.conf").write_text(f"listener {port} 127.0.0.1\nallow_anonymous false\npersistence false\n")
    broker = subprocess.Popen([MOSQUITTO, "-c", str(tmp_path / "mosquitto.conf")], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _listening(port):
            assert time.monotonic() < deadline and broker.poll() is None, "mosquitto did not listen"
            time.sleep(0.05)
        failed = deliveries("mqtt", "failed")
        with capture_logs() as logs:
            delivery = Delivery(FAST)
            t0 = time.monotonic()
            delivery.submit(alert(), {"webhook": None, "mqtt": f"mqtt://user:pa55w0rd@127.0.0.1:{port}/alerts"})
            delivery.close(timeout_s=30)
    finally:
        broker.terminate()
        broker.wait()
    assert deliveries("mqtt", "failed") == failed + 1
    errors = [e["error"] for e in logs if e["event"] == "alert delivery failed"]
    assert errors == ["MQTT broker refused the connection: Not authorized"] * FAST.attempts, logs
    assert time.monotonic() - t0 < FAST.attempts * FAST.timeout_s, "no attempt waited out its timeout"
    assert not any("pa55w0rd" in str(e) for e in logs)


def test_mqtt_delivery_through_mosquitto(tmp_path):
    with broker(tmp_path, "site/alerts") as mq:
        delivery = Delivery(FAST)
        sent = [alert(n) for n in range(2)]
        for a in sent:
            delivery.submit(a, {"webhook": None, "mqtt": mq.url})
        delivery.close(timeout_s=10)
        # through the broker to its subscriber: milliseconds, unless the machine is loaded
        deadline = time.monotonic() + 30
        while len(mq.messages) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert [m["id"] for m in mq.messages] == [a.id for a in sent]
    assert mq.messages[0]["question"] == "Is the door open?"


class Scorer:
    """Stands in for a model that can see (tiny-random cannot): says yes on the versions listed."""

    def __init__(self, yes_on: set[int]):
        self.yes_on, self.asked = yes_on, []

    def __call__(self, version, prompt: str) -> str:
        raise AssertionError("alert jobs score choices; they never generate")

    def choose(self, version, question: str, choices: Sequence[str]) -> list[float]:
        self.asked.append((version.id, question, tuple(choices)))
        return [-0.1, -3.0] if version.id in self.yes_on else [-3.0, -0.1]


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime(load_model("tiny-random"))


def test_the_api_webhook_and_mqtt_tell_an_alert_in_one_json_shape():
    """Numbers as numbers (Redis keeps strings), the frame as a URL, the time also in ISO 8601:
    what /api/alerts answers from a stored entry is what the webhook and MQTT were sent."""
    a = Alert(
        "a1", "cam1", "door", "Is the door open?", 0.93, 0.5, 7, 0.0, 2.0, 1764288000.25, frame_path("cam1", "a1")
    )
    told = alert_payload(a.fields())
    assert told == json.loads(json.dumps(a.payload()))
    assert told["score"] == 0.93 and told["version"] == 7 and isinstance(told["t_end"], float)
    assert told["frame"] == "/api/streams/cam1/alerts/a1/frame.jpg"
    assert told["at_iso"] == "2025-11-28T00:00:00.250+00:00"
    # stored before frames were URLs: the Redis key of the copy becomes its URL; no frame: null
    old = a.fields() | {"frame": keys.alert_frame("cam1", "a1")}
    assert alert_payload(old)["frame"] == told["frame"]
    assert alert_payload(a.fields() | {"frame": ""})["frame"] is None


def test_alert_job_writes_entries_with_a_frame_copy_and_delivers(rt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    r.hset(keys.latest_frame("cam1"), mapping={"jpeg": b"\xff\xd8jpeg", "seq": 7, "ts": 3.5})
    settings = AlertSettings(frame_ttl_s=600, base_url="http://nvr.lan:8080/")
    with webhook() as hook, broker(tmp_path, "site/alerts") as mq:
        job = Job(
            name="door", stream="cam1", kind="alert", prompt="Is the door open?", every_versions=1, cooldown_s=0.0,
            webhook=hook.url, mqtt=mq.url,
        )  # fmt: skip
        scorer = Scorer(yes_on={2, 3, 5})
        runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], scorer, alerts=settings)
        for i in range(5):
            engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [i, i + 0.5], [2 * i, 2 * i + 1])
            assert runner.run_due() == 1
        runner.flush()
        retained = mq.retained("#", count=3)
        states = [p for t, p, _ in mq.raw if t == "site/alerts/cam1/door"]
    assert [q for _, q, _ in scorer.asked] == ["Is the door open?"] * 5
    assert scorer.asked[0][2] == ("yes", "no")
    entries = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.alerts("cam1"))]
    # yes on versions 2, 3 (one alert: it stayed yes), no on 4, yes on 5 (turned to yes again)
    assert [int(e["version"]) for e in entries] == [2, 5]
    assert all(float(e["score"]) > 0.9 and e["job"] == "door" for e in entries)
    assert float(entries[0]["t_start"]) == 0.0 and float(entries[0]["t_end"]) == 1.5
    for e in entries:  # the frame: a URL under the API's address, served from the copy (alert_frame_ttl_s)
        assert e["frame"] == f"http://nvr.lan:8080/api/streams/cam1/alerts/{e['id']}/frame.jpg"
        copy = keys.alert_frame("cam1", e["id"])
        assert r.hget(copy, "jpeg") == b"\xff\xd8jpeg" and 0 < r.ttl(copy) <= 600
    assert [a["id"] for a in hook.accepted] == [m["id"] for m in mq.messages] == [e["id"] for e in entries]
    assert hook.accepted == mq.messages == [alert_payload(e) for e in entries]
    # the state topic: off at start, on at each alert, off when the answer turned back to no (v4)
    assert states == [b"OFF", b"ON", b"OFF", b"ON"]
    # a subscriber that comes later (Home Assistant restarting) reads the sensor, its state and the last alert
    config = json.loads(retained["homeassistant/binary_sensor/streamvqa/cam1_door/config"])
    assert config["state_topic"] == "site/alerts/cam1/door" and config["device"]["name"] == "cam1"
    assert (config["payload_on"], config["payload_off"]) == ("ON", "OFF")
    assert retained[config["state_topic"]] == b"ON"
    assert json.loads(retained[config["json_attributes_topic"]]) == alert_payload(entries[-1])
    assert "site/alerts" not in retained, "the alert events themselves are not retained"


def test_a_restarted_worker_fires_again_only_after_the_answer_turned_to_no(rt, redis_url):
    """Every worker restart fired the alert again, with a new id, for the state it had alerted on
    (for the very same version, of a file that had ended): receivers could not drop it by its id."""
    r = redis.Redis.from_url(redis_url)
    grid = choose_grid(56, 56, min_pixels=4 * 28 * 28)
    engine = StreamEngine(rt, StreamSpec("cam1", 2.0, grid, 2))
    chunks = iter(range(100))

    def worker_life(hook_url: str, yes_on: set[int], new_chunks: int) -> None:
        """One worker's life: the job runs on the head as it finds it, then on each new chunk."""
        job = Job(
            name="door", stream="cam1", kind="alert", prompt="Is the door open?", every_versions=1, cooldown_s=0.0,
            webhook=hook_url,
        )  # fmt: skip
        runner = JobRunner(r, lambda s: engine.head, [job], ["cam1"], Scorer(yes_on))
        runner.run_due()
        for _ in range(new_chunks):
            i = next(chunks)
            engine.append([np.full((56, 56, 3), i, np.uint8)] * 2, [i, i + 0.5], [2 * i, 2 * i + 1])
            runner.run_due()
        runner.flush()

    yes_on = {2, 3, 5}
    with webhook() as hook:
        worker_life(hook.url, yes_on, 2)  # yes on version 2: fires
        worker_life(hook.url, yes_on, 0)  # restarted, no new video: version 2 again, still yes
        worker_life(hook.url, yes_on, 1)  # restarted, version 3: still yes
        worker_life(hook.url, yes_on, 1)  # version 4: no
        worker_life(hook.url, yes_on, 1)  # restarted after that no, version 5: yes again, fires
    entries = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.alerts("cam1"))]
    assert [int(e["version"]) for e in entries] == [2, 5]
    assert [a["id"] for a in hook.accepted] == [e["id"] for e in entries]


def test_a_resumed_gate_keeps_what_is_left_of_the_cooldown():
    gate = Gate(debounce=1, cooldown_s=60.0)
    gate.resume(fired_ago_s=50.0, armed=True, now=1000.0)  # fired before a restart, then a no
    assert not gate.observe(True, 1000.0), "10 s of the cooldown are left"
    assert gate.observe(True, 1010.0)
    quiet = Gate(debounce=1, cooldown_s=0.0)
    quiet.resume(fired_ago_s=3600.0, armed=False, now=1000.0)  # fired before a restart, no no since
    assert not quiet.observe(True, 1000.0) and not quiet.observe(True, 2000.0)
    assert not quiet.observe(False, 2001.0) and quiet.observe(True, 2002.0)
