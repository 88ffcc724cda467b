"""Metrics and health as an operator sees them: each process exports its own families, the
health endpoints tell ready from not, and the Grafana dashboard queries only real metrics."""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from common import health, metrics
from qa_worker.answering import queue_wait_s
from tests.conftest import free_port

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana-dashboard.json"


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:  # at once, unless loaded
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def families(port: int) -> set[str]:
    _, body = get(port, "/metrics")
    return {f.name for f in text_string_to_metric_families(body.decode())}


def serve(roles: list[str], readiness: health.Readiness) -> int:
    port = free_port()
    health.serve(port, metrics.registry_for(roles), readiness)
    return port


def test_each_role_exports_only_its_own_families():
    ingest = families(serve(["ingest"], health.Readiness()))
    qa = families(serve(["qa"], health.Readiness()))
    worker = families(serve(["worker"], health.Readiness()))
    assert "svqa_build_info" in ingest & qa & worker
    assert not any(n.startswith(("svqa_qa_", "svqa_encoder_", "svqa_cache_")) for n in ingest), ingest
    assert not any(n.startswith(("svqa_ingest_", "svqa_encoder_")) for n in qa), qa
    assert {"svqa_qa_queue_wait_seconds", "svqa_encoder_chunk_seconds"} <= worker


def test_the_kv_pool_is_read_at_every_scrape():
    """Capacity, used and peak slots and the caches' re-layouts, as the pool counts them right now."""
    import torch

    from common.engine.pool import KVPool

    pool = KVPool((2, 1, 4), torch.float32, torch.device("cpu"), slab_tokens=1024, page_tokens=64)
    metrics.watch_pool(pool)
    port = serve(["worker"], health.Readiness())

    def scraped() -> dict[tuple[str, str], float]:
        body = get(port, "/metrics")[1].decode()
        return {
            (s.name, next(iter(s.labels.values()))): s.value
            for f in text_string_to_metric_families(body)
            if f.name in ("svqa_kv_pool_tokens", "svqa_kv_relayouts")
            for s in f.samples
        }

    region = pool.alloc(100)
    pool.relayouts["copied"] += 1
    assert scraped() == {
        ("svqa_kv_pool_tokens", "capacity"): 1024,
        ("svqa_kv_pool_tokens", "used"): 128,  # two pages
        ("svqa_kv_pool_tokens", "peak"): 128,
        ("svqa_kv_relayouts_total", "in_place"): 0,
        ("svqa_kv_relayouts_total", "copied"): 1,
    }
    del region
    assert scraped()[("svqa_kv_pool_tokens", "used")] == 0


def test_totals_are_counters_with_their_total_suffix():
    """What only grows (evictions, re-layouts, compiles, allocator retries, alerts) is a counter, so
    rate() and increase() apply; as gauges they read as levels and a restart looked like a fall."""
    from types import SimpleNamespace

    stats = SimpleNamespace(evictions=3, tokens_evicted=96)
    metrics.record_version("cam-totals", SimpleNamespace(tokens=10, kv_bytes=lambda: 40, stats=stats, id=7))
    body = get(serve(["worker"], health.Readiness()), "/metrics")[1].decode()
    found = {f.name: f for f in text_string_to_metric_families(body)}
    for name in ("svqa_cache_evictions", "svqa_cache_tokens_evicted", "svqa_kv_relayouts", "svqa_gpu_compiles"):
        assert found[name].type == "counter", name
    for name in ("svqa_gpu_alloc_retries", "svqa_alerts", "svqa_alert_deliveries"):
        assert found[name].type == "counter", name
    samples = {(s.name, s.labels.get("stream")): s.value for f in found.values() for s in f.samples}
    assert samples[("svqa_cache_evictions_total", "cam-totals")] == 3
    assert samples[("svqa_cache_tokens_evicted_total", "cam-totals")] == 96
    assert samples[("svqa_gpu_alloc_retries_total", None)] == 0  # no CUDA here
    assert samples[("svqa_cache_version", "cam-totals")] == 7


def test_readiness_follows_redis_model_and_leases(redis_url):
    ready = health.Readiness(redis_url=redis_url, needs_model=True)
    port = serve(["encoder"], ready)
    assert get(port, "/health/live")[0] == 200
    code, body = get(port, "/health/ready")
    assert code == 503 and json.loads(body)["checks"] == {"redis": True, "model": False}
    ready.model_loaded = True
    # A lease loop of 60 s where the checks below need it fresh (they may take a while on a loaded
    # machine), of 0.2 s where it must have gone stale.
    ready.leases_checked(["cam1"], period_s=60)
    code, body = get(port, "/health/ready")
    assert code == 200 and json.loads(body)["leases"] == ["cam1"]
    ready.leases_checked(["cam1"], period_s=0.2)
    time.sleep(0.5)  # the lease loop stopped running: no longer ready
    assert get(port, "/health/ready")[0] == 503
    ready.leases_checked(["cam1"], period_s=60)
    ready.frames_redis_url = f"redis://127.0.0.1:{free_port()}/0"  # the frames Redis gone
    code, body = get(port, "/health/ready")
    assert code == 503 and json.loads(body)["checks"] == {
        "redis": True,
        "frames_redis": False,
        "model": True,
        "leases": True,
    }
    ready.frames_redis_url = redis_url
    assert get(port, "/health/ready")[0] == 200
    ready.redis_url = f"redis://127.0.0.1:{free_port()}/0"  # Redis gone
    code, body = get(port, "/health/ready")
    assert code == 503 and json.loads(body)["checks"]["redis"] is False


def test_busy_port_raises():
    port = serve(["qa"], health.Readiness())
    with pytest.raises(OSError):
        health.serve(port, metrics.registry_for(["qa"]))


def test_queue_wait_is_measured_from_the_entry_id():
    now_ms = int(time.time() * 1000)
    assert 1.9 < queue_wait_s(f"{now_ms - 2000}-0") < 60  # seconds, not ms; the rest is this machine's pace
    assert queue_wait_s(f"{now_ms + 60_000}-0") == 0.0  # a clock ahead of ours never goes negative
    assert queue_wait_s("custom-id") == 0.0


def test_torch_compile_is_counted_at_every_scrape():
    """Graphs torch.compile made, and code it declined (here: past a recompile limit of 1, so it
    runs eager), as dynamo counts them: a GPU service that compiles while serving shows it."""
    import torch
    import torch._dynamo

    port = serve(["worker"], health.Readiness())

    def scraped() -> dict[str, float]:
        body = get(port, "/metrics")[1].decode()
        families = text_string_to_metric_families(body)
        return {s.labels["outcome"]: s.value for f in families if f.name == "svqa_gpu_compiles" for s in f.samples}

    before = scraped()
    double = torch.compile(lambda x: x * 2, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=1):  # its own patch: a monkeypatch's undo hides the entry
        double(torch.ones(2))
        double(torch.ones(2, dtype=torch.float64))  # another variant, past the limit
    after = scraped()
    assert after["compiled"] - before["compiled"] == 1
    assert after["not_compiled"] - before["not_compiled"] == 1


def test_dashboard_queries_only_metrics_the_code_defines_and_covers_them_all():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"\bsvqa_[a-z_]+", e)}
    defined = metrics.all_names()
    assert used <= defined, used - defined
    assert defined <= used, f"not on the dashboard: {defined - used}"


def test_ingest_fps_falls_to_zero_when_frames_stop(monkeypatch):
    """The gauge is computed when scraped: a dead camera reads 0, not its last rate."""
    from ingest import source

    clock = [1000.0]
    monkeypatch.setattr(source.time, "monotonic", lambda: clock[0])
    fake = source.Source.__new__(source.Source)
    fake._recent = source.deque([clock[0] - 0.5 * i for i in range(10)])  # 2 fps for 5 s
    assert fake.recent_fps() == pytest.approx(10 / source.FPS_WINDOW_S)
    clock[0] += source.FPS_WINDOW_S + 1
    assert fake.recent_fps() == 0.0


def test_ingest_fps_is_read_while_frames_are_appended():
    """A scrape runs on the metrics server's thread while the source appends publish times."""
    from ingest import source

    fake = source.Source.__new__(source.Source)
    fake._recent = source.deque(maxlen=source.FPS_WINDOW_FRAMES)
    stop = threading.Event()

    def publish() -> None:
        while not stop.is_set():
            fake._recent.append(time.monotonic())

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert fake.recent_fps() >= 0
    finally:
        stop.set()
        publisher.join()


def test_thread_exceptions_are_json_log_lines(capsys):
    from common.logs import configure_logging

    configure_logging("INFO")
    t = threading.Thread(target=lambda: 1 / 0, name="boom")
    t.start()
    t.join()
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["thread"] == "boom" and record["exception"][0]["exc_type"] == "ZeroDivisionError"


def test_console_logs_go_to_stderr_as_it_is_at_each_write(capsys):
    """`json=False`: readable lines, on whatever sys.stderr is when a line is written (pytest
    swaps it between tests), secrets redacted as in JSON lines."""
    import structlog

    from common.logs import configure_logging

    configure_logging("INFO", json=False)
    try:
        structlog.get_logger().info("camera added", url="rtsp://admin:hunter2@cam/1")
        err = capsys.readouterr().err
    finally:
        configure_logging("INFO")
    assert "camera added" in err and "hunter2" not in err and not err.lstrip().startswith("{")


def test_a_slow_gpu_step_and_a_long_garbage_collection_each_log_one_line(capsys, monkeypatch):
    """The GPU loop stood still: the line says which step, how long, and what happened meanwhile
    (garbage collected here; compiles are counted the same way, allocator retries since start)."""
    from common import stalls
    from common.engine.scheduler import SchedulePolicy, Scheduler
    from common.logs import configure_logging

    configure_logging("INFO")
    monkeypatch.setattr(stalls, "LONG_GC_S", 0.0)
    watch = stalls.StallWatch(slow_s=1.0)  # a second: the quick step stays quick on a loaded machine
    scheduler = Scheduler(SchedulePolicy(), on_step=watch.on_step).start()
    try:
        scheduler.call(lambda: 1)  # a quick step: no line
        scheduler.call(lambda: (gc.collect(), time.sleep(1.1)))
    finally:
        scheduler.stop()
        watch.close()
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    slow = [r for r in records if r["event"] == "gpu step slow"]
    assert len(slow) == 1, records
    assert slow[0]["kind"] == "task" and slow[0]["seconds"] >= 1.1 and slow[0]["units"] == 1
    assert slow[0]["gc_s"] > 0 and slow[0]["compiled_frames"] == 0 and slow[0]["alloc_retries_total"] == 0
    assert any(r["event"] == "long garbage collection" and r["generation"] == 2 for r in records)
    assert watch._on_gc not in gc.callbacks


def _spin_in_the_loop(sampler: object, seconds: float, samples: int, limit_s: float = 30.0) -> None:
    """At least `seconds`, and until `sampler` has counted the loop `samples` times: on a loaded
    machine (two cores, a whole suite beside) its thread may get the GIL only a few times a second.
    The count is read in C (no frame of this function's own is ever the loop's innermost)."""
    start, counted = time.monotonic(), sampler._loop.values  # one line below: one place sampled
    while (t := time.monotonic() - start) < limit_s and (t < seconds or sum(counted()) < samples):
        pass


def _spin_beside(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_a_slow_steps_line_says_where_the_loop_and_the_busy_threads_were(capsys):
    """The sampler names the loop's place and a busy thread's (by its name), not threads waiting
    on a lock, and nothing for a quick step."""
    from common import stalls
    from common.engine.scheduler import Scheduler
    from common.logs import configure_logging

    configure_logging("INFO")
    # slow_s well above the first step's 0.2 s: a sleep that a loaded machine wakes late from
    # must not make that step slow too
    watch, stop = stalls.StallWatch(slow_s=1.0), threading.Event()
    scheduler = Scheduler(on_step=watch.on_step).start()
    watch.sampler = stalls.StepSampler(scheduler, after_s=0.1).start()
    busy = threading.Thread(target=_spin_beside, args=(stop,), name="stream_7", daemon=True)
    waiting = threading.Thread(target=stop.wait, name="idle_3", daemon=True)
    busy.start(), waiting.start()
    try:
        scheduler.call(lambda: time.sleep(0.2))  # over after_s, under slow_s: sampled, not logged
        scheduler.call(lambda: _spin_in_the_loop(watch.sampler, 1.2, samples=8))
    finally:
        stop.set()
        scheduler.stop()
        watch.close()
    slow = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    slow = [r for r in slow if r["event"] == "gpu step slow"]
    assert len(slow) == 1, slow
    loop_at, busy_at = slow[0]["loop_at"], slow[0]["busy_at"]
    top = max(loop_at, key=loop_at.get)  # a sample may straddle the steps' edge: most are inside
    assert " _spin_in_the_loop < " in top and loop_at[top] >= 5 and sum(loop_at.values()) - loop_at[top] <= 1, loop_at
    assert any(p.startswith("stream ") and "_spin_beside" in p for p in busy_at), busy_at
    assert not any("idle" in p or "time.sleep" in p for p in busy_at), busy_at
    assert slow[0]["sampler_late_max_s"] >= 0


def test_the_stuck_watch_reports_a_step_past_its_limit_once_and_a_long_one_within_it_never():
    from common.engine.scheduler import Scheduler
    from common.stalls import StuckWatch

    release, reported = threading.Event(), []
    scheduler = Scheduler().start()
    try:
        # a limit well above the long step's 0.5 s: a sleep that a loaded machine wakes late from
        # stays within it
        StuckWatch(scheduler, 2.0, lambda seconds, stack: reported.append((seconds, stack))).start()
        scheduler.call(lambda: time.sleep(0.5))  # long, but within the limit
        time.sleep(2.5)  # idle between steps is not a step
        assert reported == []
        threading.Thread(target=scheduler.call, args=(release.wait,), daemon=True).start()
        deadline = time.monotonic() + 10
        while not reported and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # once, not every second after
    finally:
        release.set()
        scheduler.stop()
    assert len(reported) == 1, reported
    seconds, stack = reported[0]
    assert seconds > 2.0 and any(frame.endswith(" wait") for frame in stack), stack


def test_writing_a_profile_after_a_step_is_not_a_stuck_step(tmp_path, monkeypatch):
    """A trace is written when its last step ends, in the loop's thread (seconds to minutes on a
    GPU): the stuck watch times the steps, not the writing."""
    from common.engine.profiling import StepProfiler
    from common.engine.scheduler import Scheduler
    from common.stalls import StuckWatch

    finish = StepProfiler._finish

    def slow_finish(self: StepProfiler) -> None:
        finish(self)
        time.sleep(1.5)

    monkeypatch.setattr(StepProfiler, "_finish", slow_finish)
    profiler, reported = StepProfiler(tmp_path, steps=1), []
    scheduler = Scheduler(profiler=profiler).start()
    try:
        StuckWatch(scheduler, 0.5, lambda seconds, stack: reported.append(seconds)).start()
        profiler.request()
        scheduler.call(lambda: None)
        time.sleep(1.0)  # the watch looks every 0.125 s
    finally:
        scheduler.stop()
    assert len(profiler.written) == 2 and reported == []


def test_the_heap_alive_after_start_up_is_frozen_out_of_later_collections():
    from common.stalls import freeze_heap

    alive = [[i] for i in range(10_000)]  # containers, which collections walk
    try:
        assert freeze_heap() >= len(alive)
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert not any(id(x) in walked for x in alive)
    finally:
        gc.unfreeze()
    assert all(id(x) in {id(o) for o in gc.get_objects()} for x in alive[:10])


def test_thread_cpu_is_counted_by_role_and_only_grows():
    from common.threadcpu import ThreadCPU, role

    assert [role(n) for n in ("stream_12", "question_3", "ingest:cam001", "Thread-5 (run)", "gpu-scheduler")] == [
        "stream",
        "question",
        "ingest",
        "Thread",
        "gpu-scheduler",
    ]
    threads, stop, spent = ThreadCPU(), threading.Event(), threading.Event()
    first = threads.totals()

    def spin() -> None:  # until it has used 0.2 s of CPU by its own clock, however busy the machine
        while not stop.is_set():
            if time.thread_time() >= 0.2:
                spent.set()

    busy = threading.Thread(target=spin, name="busy_7")
    busy.start()
    try:
        assert spent.wait(60)
        during = threads.totals()
    finally:
        stop.set()
        busy.join()
    assert during["busy"] >= 0.1  # of the 0.2 s it used (ticks are 10 ms)
    after = threads.totals()  # it has ended: what it used stays counted
    assert after["busy"] == during["busy"] and all(after[k] >= first.get(k, 0.0) for k in after)


def test_a_step_trace_that_cannot_be_written_is_a_warning_and_the_loop_goes_on(tmp_path, monkeypatch):
    from common.engine.phases import phase
    from common.engine.profiling import StepProfiler

    def run_steps(profiler: StepProfiler, n: int) -> None:
        profiler.request()
        for _ in range(n):
            with profiler.step(), phase("encode"), phase("vision"):
                torch.ones(4).sum()

    written = StepProfiler(tmp_path / "ok", steps=2)
    run_steps(written, 2)
    assert sorted(p.suffix for p in written.written) == [".gz", ".txt"] and all(p.exists() for p in written.written)
    names = {e.get("name") for e in json.loads(gzip.decompress(written.written[0].read_bytes()))["traceEvents"]}
    assert {"encode", "vision"} <= names  # the step's kind, and a phase inside it
    assert isinstance(phase("vision"), contextlib.nullcontext)  # no trace being taken: nothing labelled

    def broken(self, path):
        raise UnicodeDecodeError("utf-8", b"\xd5", 0, 1, "unexpected end of data")  # as with_stack=True once did

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", broken)
    failed = StepProfiler(tmp_path / "broken", steps=2)
    run_steps(failed, 3)  # the third step runs unprofiled, after the failed write
    assert failed.written == [] and not list((tmp_path / "broken").glob("gpu-steps-*"))


def test_a_phase_clock_times_each_phase_apart_from_those_nested_in_it():
    """Wall and CPU by phase, exclusive: a phase's nested one is not counted twice, a sleep is wall
    without CPU, and a thread without a clock times nothing."""
    from common.engine.phases import PhaseClock, clock_this_thread, phase

    clock = PhaseClock()
    clock_this_thread(clock)
    try:
        t0 = time.perf_counter()
        with phase("encode"):
            busy_until = time.perf_counter() + 0.05
            while time.perf_counter() < busy_until:
                pass
            before_wait = time.perf_counter()
            with phase("device wait"):
                slept = time.perf_counter()
                time.sleep(0.1)
                slept = time.perf_counter() - slept
            waited = time.perf_counter() - before_wait
        elapsed = time.perf_counter() - t0
    finally:
        clock_this_thread(None)
    assert isinstance(phase("vision"), contextlib.nullcontext)  # no clock, no trace: nothing
    assert set(clock.wall) == {"encode", "device wait"}
    # the sleep, and nothing of the encode phase around it (bounds measured around the phase,
    # not a fixed 50 ms that a loaded machine's late wake-up could pass)
    assert 0.1 <= slept <= clock.wall["device wait"] <= waited
    assert clock.wall["encode"] >= 0.05 and sum(clock.wall.values()) <= elapsed
    assert clock.cpu["device wait"] < 0.02 and clock.cpu["encode"] <= clock.wall["encode"] + 0.01
