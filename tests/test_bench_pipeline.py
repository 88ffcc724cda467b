"""scripts/bench_pipeline.py run as the lead runs it, as a CPU smoke run with tiny-random: every
field of its JSON with sane values, its table, and nothing it started left behind."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.engine.scheduler import STEP_KINDS

REPO = Path(__file__).resolve().parents[1]
DURATION_S = 10


def bench(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """The benchmark as a process whose temp files all land in tmp_path/tmp (checked afterwards)."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path / "tmp")}
    cmd = [sys.executable, str(REPO / "scripts" / "bench_pipeline.py"), "--model", "tiny-random", "--device", "cpu"]
    with open(tmp_path / "stderr.txt", "w") as err:
        return subprocess.Popen([*cmd, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)


def assert_nothing_left(tmp_path: Path) -> None:
    """No temp dir, and no process running from it or naming it (redis-server runs in its --dir)."""
    tmp = str(tmp_path / "tmp")
    assert list(Path(tmp).glob("svqa-bench-*")) == []  # (torch keeps its compile cache there: not ours)
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(proc / "cwd")
        except OSError:  # gone meanwhile, or another user's
            continue
        if tmp in cmdline or cwd.startswith(tmp):
            left.append(f"{proc.name}: {cmdline!r} in {cwd}")
    assert left == []


def check_spread(spread: dict[str, int], per_camera: list[int]) -> None:
    assert spread == {"min": min(per_camera), "max": max(per_camera), "total": sum(per_camera)}


def test_the_workers_gpu_samples_are_read_one_label_apart(monkeypatch):
    """What the benchmark reads of a worker's /metrics: each labelled GPU sample under its own
    label (read without theirs, `svqa_gpu_compiles`' two outcomes were one key, and the report
    said 0 compiles whatever happened), the scheduler's decode times and its time at risk."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_pipeline

    from common import health, metrics
    from common.engine.phases import PhaseClock
    from common.engine.scheduler import DecodeTimes
    from tests.conftest import free_port

    times = DecodeTimes(steps=2.5, device=2.0, idle_encode=0.25, idle_between=0.125)
    monkeypatch.setattr(metrics.DECODE_TIMES, "times", times)
    clock = PhaseClock()
    clock.wall, clock.cpu = {"prefill": 2.0, "device wait": 1.5}, {"prefill": 1.5, "device wait": 0.25}
    monkeypatch.setattr(metrics.LOOP_PHASES, "clock", clock)
    monkeypatch.setattr(metrics.GPU_AT_RISK, "read", lambda: {(): 1.5})
    port = free_port()
    health.serve(port, metrics.registry_for(["worker"]), health.Readiness())
    got = bench_pipeline.scrape(port)
    decode = {part: got[("svqa_gpu_decode_seconds_total", part, "")] for part in vars(times)}
    assert decode == {"steps": 2.5, "device": 2.0, "idle_encode": 0.25, "idle_between": 0.125}
    compiles = {("svqa_gpu_compiles_total", "compiled", ""), ("svqa_gpu_compiles_total", "not_compiled", "")}
    assert compiles <= set(got)
    assert ("svqa_gpu_alloc_retries_total", "", "") in got
    assert got[("svqa_gpu_cameras_at_risk_seconds_total", "", "")] == 1.5
    gpu = {f"{name}:{label}": value for (name, label, _), value in got.items() if name.startswith("svqa_gpu_loop_")}
    assert bench_pipeline.loop_phases(gpu.get, gpu, seconds=4.0) == {
        "device wait": {"share": 0.375, "on_cpu": 0.167},
        "prefill": {"share": 0.5, "on_cpu": 0.75},
    }


def test_the_gpus_clocks_are_read_from_nvidia_smi_lines():
    """Lines as nvidia-smi writes them for `GPU_QUERY` (an H200's, recorded; there is no GPU
    here), and the summary of a window of them; a field it cannot report is no sample."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_pipeline

    lines = [
        "1980, 1980, 3201, 312.45, 41, 88\n",
        "1755, 1980, 3201, 655.10, 47, 100\n",
        "1980, 1980, 3201, 598.70, 46, 97\n",
    ]
    samples = [bench_pipeline.parse_gpu_sample(line) for line in lines]
    assert samples[1] == {
        "clocks.sm": 1755.0,
        "clocks.max.sm": 1980.0,
        "clocks.mem": 3201.0,
        "power.draw": 655.1,
        "temperature.gpu": 47.0,
        "utilization.gpu": 100.0,
    }
    assert bench_pipeline.machine_gpu(samples) == {
        "sm_mhz": {"p50": 1980.0, "min": 1755.0},
        "max_sm_mhz": 1980.0,
        "mem_mhz_p50": 3201.0,
        "power_w": {"p50": 598.7, "max": 655.1},
        "temperature_c_max": 47.0,
        "busy_mean": 0.95,
        "samples": 3,
    }
    assert bench_pipeline.parse_gpu_sample("1980, 1980, 3201, [N/A], 41, 97") is None
    assert bench_pipeline.machine_gpu([]) is None


def test_client_latency_is_binned_by_when_questions_were_asked():
    """Answers asked at 100 + 0.5 .. 24.5 s land in the 10 s bins they were asked in, each with its
    own count and percentiles (numpy's, as for the whole window); empty bins are left out."""
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_pipeline

    asked = [bench_pipeline.Asked(100.0 + t, lat, 0.1, lat, None) for t, lat in ((0.5, 1.0), (9.9, 3.0), (24.5, 2.0))]
    assert bench_pipeline.latency_bins(asked, 100.0, 10.0) == [
        {"from_s": 0.0, "answers": 2, "p50": 2.0, "p95": 2.9},
        {"from_s": 20.0, "answers": 1, "p50": 2.0, "p95": 2.0},
    ]
    assert bench_pipeline.latency_bins([], 100.0, 10.0) == []


@pytest.mark.timeout(360)
def test_smoke_run_reports_every_field_with_sane_values(tmp_path):
    out = tmp_path / "result.json"
    proc = bench(
        tmp_path,
        *("--cameras", "2", "--workers", "2", "--askers", "1", "--duration", str(DURATION_S), "--warmup", "3"),
        *("--settle-timeout", "0", "--start-timeout", "120", "--out", str(out)),
        *("--profile", str(tmp_path / "profiles"), "--profile-steps", "3", "--failover"),
    )
    stdout, _ = proc.communicate(timeout=320)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 0, stderr[-4000:]
    run = json.loads(stdout.strip().splitlines()[-1])
    report = json.loads(out.read_text())
    assert report["runs"] == [run]
    assert report["hardware"]["cpus"] >= 1 and "--duration" in report["command"]
    # progress lines; the window's own says seconds so far (10 or 11 of 10 when its scrape is slow)
    assert "every camera has a version" in stderr and f"/{DURATION_S} s, " in stderr

    assert (run["cameras"], run["askers"], run["model"], run["device"]) == (2, 1, "tiny-random", "cpu")
    assert (run["max_tokens"], run["max_cache_tokens"]) == (32, 32768)
    assert run["segment_store"].startswith("default (shm://")  # the product's own store kind
    assert run["worker_io"]["wchar_mb_per_s"] > 0 and run["segment_store_shm_gib"]["total"] >= 0
    assert run["workers"] == 2 and run["streams_per_worker"] == {"worker-1": 2}  # one each, then the failover

    failover = run["failover"]  # worker-0 killed after the window: its camera restored by worker-1 from the store
    assert failover["streams_moved"] == failover["streams_restored"] == 1
    expired, after_kill = failover["lease_expired_after_kill_s"]["max"], failover["restored_after_kill_s"]["max"]
    assert 0 < expired <= 5.0  # lease_ms: renewed at most then
    assert 0 < failover["restored_after_lease_expiry_s"]["max"] < 30  # seconds, even on a loaded 2-core CPU
    assert abs(after_kill - expired - failover["restored_after_lease_expiry_s"]["max"]) < 0.002
    steps = failover["restore_breakdown_s"]
    assert set(steps) == {"waited_s", "read_s", "apply_s", "claim_s", "open_s", "gb"}
    assert all(v["max"] is not None and v["max"] >= 0 for v in steps.values())
    assert steps["open_s"]["max"] >= steps["read_s"]["max"] + steps["apply_s"]["max"]
    first = failover["first_version_after_kill_s"]["max"]  # the new owner's first chunk, if one came in time
    assert first is None or first >= after_kill
    assert failover["frames_dropped"] == sum(failover["frames_dropped_by_reason"].values())
    assert DURATION_S <= run["duration_s"] < DURATION_S + 5
    assert run["warmup_s"] >= 3 and isinstance(run["settled"], bool)

    frames = run["frames"]
    per_camera = frames["per_camera"]
    assert per_camera["cameras"] == ["cam000", "cam001"]
    for kind in ("published", "encoded", "dropped"):
        assert len(per_camera[kind]) == 2
        check_spread(frames[kind], per_camera[kind])
    # live cameras are paced by the wall clock: never more than fps x the window (+1 at its edge)
    assert 0.5 * 2 * DURATION_S <= frames["published"]["min"] <= frames["published"]["max"] <= 2 * run["duration_s"] + 1
    assert frames["encoded"]["min"] > 0
    assert sum(frames["dropped_by_reason"].values()) == frames["dropped"]["total"]
    assert frames["dropped_by_reason"].get("bad", 0) == 0  # late, maybe, on a busy machine; refused, never
    handled = frames["encoded"]["total"] + frames["dropped"]["total"]
    assert frames["dropped_fraction"] == round(frames["dropped"]["total"] / handled, 4)
    assert frames["not_yet_encoded_at_end"]["min"] >= 0
    assert frames["backlog_growth"]["max"] <= frames["not_yet_encoded_at_end"]["max"]
    assert run["kept_up"] == (
        run["settled"] and frames["dropped"]["total"] == 0 and frames["backlog_growth"]["total"] <= 4 * 2
    )
    assert report["max_cameras_zero_drops"] == (2 if run["kept_up"] else None)

    lag = run["encoder_lag_s"]
    assert lag["samples"] >= DURATION_S  # two heads a second, whatever the load
    assert 0 <= lag["p50"] <= lag["p95"] <= lag["max"] < 300  # seconds, on the same clock as the frames

    assert run["errors"] == 0 and run["error_samples"] == []
    assert run["answers"] > 0 and run["answers_per_s"] > 0
    client, server = run["client_latency_s"], run["server_first_token_s"]
    assert 0 < server["p50"] <= server["p95"] and client["p50"] <= client["p95"]
    assert client["p50"] >= server["p50"]  # each question's wait includes its first token
    total, outside = run["server_total_s"], run["outside_server_s"]
    assert server["p50"] <= total["p50"] <= client["p50"] and 0 <= outside["p50"] <= outside["p95"]
    queue = run["queue_wait_s"]  # asked to started on the GPU: inside each client's latency
    assert 0 <= queue["p50"] <= queue["p95"] <= queue["max"]
    assert queue["p50"] <= client["p50"] and 0 <= queue["told_a_place"] <= 1
    assert (queue["furthest_place"] is None) == (queue["told_a_place"] == 0)
    bins = run["client_latency_by_bin"]  # every answer in the bin it was asked in, bins in order
    assert sum(b["answers"] for b in bins) == run["answers"]
    assert [b["from_s"] for b in bins] == sorted({b["from_s"] for b in bins}) and bins[0]["from_s"] >= 0
    assert min(b["p50"] for b in bins) <= client["p50"] <= max(b["p95"] for b in bins)

    # two workers: their GPU-seconds add up, to at most 2 a second, plus the step each had in flight
    # when the window opened (counted whole when it ends inside): seconds long on a busy 2-core CPU
    gpu = run["gpu_steps"]
    assert gpu["encode"]["share"] > 0 and gpu["decode"]["share"] > 0
    assert sum(gpu[k]["share"] for k in STEP_KINDS) <= 3.0
    # a chunk of 4 frames per stream per step, so at most one chunk per camera in a worker's step
    assert 1 <= gpu["encode"]["units_per_step"] <= 2 and gpu["decode"]["units_per_step"] >= 1
    chunks = gpu["encode"]["units_per_step"] * gpu["encode"]["steps"]
    assert abs(4 * chunks - frames["encoded"]["total"]) <= 4 * 2 * 2  # a chunk per worker on each edge
    assert all(0 <= gpu[k]["steps_over_1s"] <= gpu[k]["steps"] for k in STEP_KINDS)
    answering = gpu["decode"]["answering"]  # shares of the window, summed over the two workers
    assert answering["on_device"] is None  # no device times the steps on a CPU
    # the steps' launch-to-read time is within each decode step's reported time (which adds a sync)
    assert 0 < answering["in_steps"] <= gpu["decode"]["share"] + 0.002
    idle = answering["idle_in_encode_steps"] + answering["idle_between_steps"]
    assert idle >= 0 and answering["in_steps"] + idle <= 2.05
    assert gpu["graph_captures"] == {"count": 0, "seconds": 0.0}  # no CUDA graphs on a CPU
    assert gpu["alloc_retries"] == 0
    assert gpu["compiles"] == {"compiled": 0, "not_compiled": 0}  # nothing compiles on a CPU
    pool = gpu["kv_pool"]  # both workers' pools, summed; no camera reaches its 32K budget in the window
    assert 0 < pool["used_tokens"] <= pool["peak_tokens"] <= pool["capacity_tokens"]
    assert pool["relayouts_in_place"] == pool["relayouts_copied"] == 0

    cores = run["worker_cpu_cores"]  # both workers' threads by role; each runs a GPU loop and a stream
    assert cores["gpu-scheduler"] > 0 and cores["stream"] > 0 and cores["MainThread"] >= 0
    assert 0 < sum(cores.values()) <= os.cpu_count()
    machine = run["machine_cpu"]  # sampled every 50 ms in the window: at least the workers' own use
    # 20 a second on an idle machine; at least 5, for a sampler thread that a saturated machine wakes late
    assert machine["cores"] == os.cpu_count() and machine["samples"] >= 5 * run["duration_s"]
    assert 0 < machine["busy_mean"] <= machine["cores"] and 0 <= machine["saturated_share"] <= 1
    assert machine["model"] is None or machine["model"].strip()
    gpu_seen = run["machine_gpu"]  # None where there is no nvidia-smi
    assert gpu_seen is None if shutil.which("nvidia-smi") is None else gpu_seen["samples"] >= 1

    memory = run["worker_memory_gib"]
    assert set(memory) == {"worker-0", "worker-1"}
    assert all(0.1 < m["rss"] <= m["peak"] < 64 for m in memory.values())
    for worker in ("worker-0", "worker-1"):  # SIGUSR2 after the window: a trace of 3 steps each, labelled by kind
        (trace,) = (tmp_path / "profiles").glob(f"*/{worker}/gpu-steps-*.json.gz")
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        assert {"encode", "decode"} & {e.get("name") for e in events}
        assert "aten::" in trace.with_suffix("").with_suffix(".txt").read_text()
        summary = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "profile_summary.py"), str(trace)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert summary.returncode == 0, summary.stderr
        kinds = {k: v for k, v in json.loads(summary.stdout).items() if k in STEP_KINDS}
        assert 3 <= sum(v["steps"] for v in kinds.values()) <= 9  # a step: task, decode and encode at most
        assert all(v["wall_ms"] > 0 and v["device_busy_ms"] == 0 for v in kinds.values())  # a CPU: no kernels
        assert all(abs(v["idle_ms"]["before_first"] - v["wall_ms"]) <= 0.02 for v in kinds.values())

    table = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "plot_pipeline.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    row = table.stdout.splitlines()[2]
    assert row.startswith("| 2 | 1 | ") and row.endswith(f"| {'yes' if run['kept_up'] else 'no'} |")
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(420)
def test_smoke_run_about_the_past_reports_every_field_with_sane_values(tmp_path, monkeypatch):
    """--history-askers, --retrieval-askers, --search-clients beside the live askers: the past
    pre-filled (3 minutes of frames, 90 chunks a camera), a recorder going on with it live, and
    every question and search answered from it."""
    monkeypatch.setenv("SVQA_FEATURES_SAVE_S", "2")  # the recorder's: live chunks reach the index in the window
    monkeypatch.setenv("SVQA_HISTORY_MAX_TOKENS", "1100")  # the workers': two chunks a question (a CPU is slow)
    out = tmp_path / "result.json"
    proc = bench(
        tmp_path,
        *("--cameras", "2", "--askers", "1", "--history-askers", "1", "--retrieval-askers", "1"),
        *("--search-clients", "1", "--log-hours", "0.05", "--index-hours", "0.05", "--past-pause", "0.2"),
        *("--duration", str(DURATION_S), "--warmup", "3", "--settle-timeout", "0", "--start-timeout", "120"),
        *("--out", str(out)),
    )
    stdout, _ = proc.communicate(timeout=380)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 0, stderr[-4000:]
    run = json.loads(stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text())["runs"] == [run]
    assert "the past pre-filled in" in stderr
    assert run["errors"] == 0 and run["answers"] > 0  # the live askers, as ever

    for kind, since, scope in (("history", 600.0, "the span's chunks, evenly"), ("retrieval", 3600.0, "history")):
        past = run[kind]
        assert (past["askers"], past["since_s"], past["scope"], past["pause_s"]) == (1, since, scope, 0.2)
        assert past["errors"] == 0 and past["error_samples"] == [] and past["answers"] >= 1, past
        client, server = past["client_first_token_s"], past["server_first_token_s"]
        assert 0 < client["p50"] <= client["p95"] <= past["client_latency_s"]["p95"]
        parts = past["queue_s"]["p50"] + past["prepare_s"]["p50"] + past["first_token_from_start_s"]["p50"]
        assert past["answers"] > 1 or server["p50"] == pytest.approx(parts, abs=0.01)  # one answer: its parts
        assert (
            past["queue_s"]["p50"] >= 0 and min(past["prepare_s"]["p50"], past["first_token_from_start_s"]["p50"]) > 0
        )
        assert 0 < server["p50"] <= client["p50"] + 0.05  # the server's clock counts from the entry id (ms)

    search = run["search"]
    assert (search["clients"], search["since_s"]) == (1, 180.0)
    assert search["errors"] == 0 and search["searches"] >= 1
    assert search["hits"] == {"min": 10, "max": 10}  # the default limit; 2 x 90 chunks indexed
    assert 0 < search["server_s"]["p50"] <= search["client_latency_s"]["p50"]

    prefilled = run["past"]["prefilled"]
    assert (prefilled["cameras"], prefilled["frames_per_camera"], prefilled["chunks_per_camera"]) == (2, 360, 90)
    assert prefilled["distinct_frames"] == 120 and prefilled["log_bytes"] > 0 and prefilled["seconds"] > 0
    log = run["past"]["log"]  # the live frames joined the past's, in one log
    assert log["frames"]["min"] > 360 and log["hours"]["min"] > 0.05 and 0 <= log["newest_frame_age_s"] < 30
    index = run["past"]["index"]
    assert index["chunks"] > 2 * 90, "the recorder added live chunks to the pre-filled indexes (same model, size)"
    assert index["camera_hours"] == round(index["chunks"] * 4 / 2.0 / 3600, 3)
    vectors = 1800 * 64 * 2  # bytes of a camera-hour's vectors: 1,800 chunks of 64 float16 (tiny-random)
    assert index["disk_bytes_per_camera_hour"] > vectors and index["held_bytes_per_camera_hour"] > vectors
    mapped = index["mapped"]["worker-0"]  # the worker searched: it maps every camera's graph
    assert 0 < mapped["resident_bytes"] <= mapped["mapped_bytes"]
    recorder = run["past"]["recorder"]
    assert recorder["memory_gib"]["rss"] > 0 and recorder["io"]["wchar_mb_per_s"] > 0
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(240)
def test_interrupt_stops_every_process_and_removes_the_temp_dir(tmp_path):
    proc = bench(
        tmp_path, "--cameras", "1", "--askers", "1", "--warmup", "0", "--settle-timeout", "0", "--duration", "600"
    )
    deadline = time.monotonic() + 180
    while " asked, " not in (tmp_path / "stderr.txt").read_text():  # measuring: every part is running
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stdout == ""
    assert "interrupted" in (tmp_path / "stderr.txt").read_text()
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(180)
def test_a_service_that_dies_fails_the_run_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("SVQA_CHUNK_FRAMES", "3")  # the services read SVQA_*: the worker refuses to start
    proc = bench(tmp_path, "--cameras", "1", "--askers", "1", "--duration", "5", "--logs", str(tmp_path / "logs"))
    stdout, _ = proc.communicate(timeout=150)
    assert proc.returncode == 1, (tmp_path / "stderr.txt").read_text()
    (run,) = [json.loads(line) for line in stdout.splitlines()]
    assert run["cameras"] == 1 and run["failed"].startswith("worker-0 exited with 2: ")
    assert "chunk_frames must be a positive even number" in run["failed"]
    (log,) = (tmp_path / "logs").glob("*/worker-0.log")  # kept for a post-mortem
    assert "chunk_frames must be a positive even number" in log.read_text()
    assert_nothing_left(tmp_path)


def test_profile_summary_places_idle_and_busy_device_time_by_the_op_the_loop_was_in():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import profile_summary
    finally:
        sys.path.remove(str(REPO / "scripts"))
    step = {"cat": "user_annotation", "name": "encode", "ts": 0.0, "dur": 100.0, "tid": 1}
    events = [
        step,
        {"cat": "kernel", "name": "k1", "ts": 10.0, "dur": 20.0, "args": {"correlation": 7}},
        {"cat": "kernel", "name": "k2", "ts": 50.0, "dur": 40.0, "args": {"correlation": 8}},
        {"cat": "kernel", "name": "k3", "ts": 55.0, "dur": 10.0},  # overlaps k2: counted once
        {
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 5.0,
            "dur": 1.0,
            "tid": 1,
            "args": {"correlation": 7},
        },
        {
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": 49.0,  # in aten::linear, after aten::item
            "dur": 1.0,
            "tid": 1,
            "args": {"correlation": 8},
        },
        {"cat": "cpu_op", "name": "aten::linear", "ts": 25.0, "dur": 30.0, "tid": 1},
        {"cat": "cpu_op", "name": "aten::item", "ts": 28.0, "dur": 20.0, "tid": 1},  # innermost at 30
        {"cat": "cpu_op", "name": "aten::mm", "ts": 29.0, "dur": 5.0, "tid": 2},  # another thread's
        {"cat": "user_annotation", "name": "prefill", "ts": 20.0, "dur": 40.0, "tid": 1},  # a phase of the step
    ]
    (encode,) = profile_summary.summarize(events).values()
    assert encode["device_busy_ms"] == 0.06 and encode["device_idle_share"] == 0.4
    assert encode["idle_ms"] == {
        "before_first": 0.01,
        "after_last": 0.01,
        "between": 0.02,
        "between_by_op": {"aten::item": 0.02},
        "between_by_phase": {"prefill": 0.02},
    }
    # each kernel's time goes to the phase and op its launch was made in (k3's launch is not traced)
    assert encode["device_ms"] == {
        "by_phase": {"prefill": 0.04, "(no phase)": 0.02, "(unknown)": 0.01},
        "by_phase_op": {"prefill / aten::linear": 0.04, "(no phase) / (python)": 0.02, "(unknown) / (unknown)": 0.01},
    }


def test_gil_holders_are_summarised_by_thread_and_by_the_call_of_ours_that_holds_it():
    """py-spy's raw lines (the format 0.4.3 writes with --threads --full-filenames, recorded): a
    thread's role from its name, the call from the innermost frame of the repository's code."""
    from scripts.gil_holders import summarize

    py = "/usr/lib/python3.12/threading.py"
    raw = "\n".join(
        [
            f"thread (101): stream_3;Thread.run ({py}:982);_process ({REPO}/encoder_worker/service.py:310);"
            f"flush ({REPO}/encoder_worker/owned_stream.py:172);rgb ({REPO}/common/wire/schemas.py:90);"
            f"open (/x/.venv/lib/PIL/Image.py:3400) 30",
            f"thread (102): gpu-scheduler;_run ({REPO}/common/engine/scheduler.py:210);"
            f"_layers ({REPO}/common/engine/lm.py:380) 60",
            f"thread (103): stream_12;Thread.run ({py}:982) 10",
            "garbage line",
        ]
    )
    assert summarize(raw, REPO, window_s=4.0) == {
        "samples": 100,
        "seconds": 1.0,
        "held_share": 0.25,
        "by_thread": {"gpu-scheduler": 0.6, "stream": 0.4},
        "by_call": [
            {"thread": "gpu-scheduler", "call": "_layers (common/engine/lm.py:380)", "share": 0.6},
            {"thread": "stream", "call": "rgb (common/wire/schemas.py:90)", "share": 0.3},
            {"thread": "stream", "call": "(outside the repository)", "share": 0.1},
        ],
    }


def test_the_prefilled_past_is_what_ingest_and_a_recorder_would_have_left(tmp_path, monkeypatch):
    """scripts/history_fixture.py: every logged record is byte for byte the frames entry ingest
    publishes for that frame of the video (played in a loop) at that seq and capture time, in files
    of ROLL_S of capture time ending now; the index holds a vector a chunk of the model's size,
    each layer's part of unit length, and over the logged span exactly the chunks a history
    question reads back from the log; every camera has its own copy."""
    from apps.samplevideo import write_sample_video
    from common.chunkindex import GRAPH_NAME, META_NAME, ChunkIndex
    from common.framelog import FrameLog
    from common.wire.schemas import FIELD, FrameMsg, encode_frame
    from ingest.video import iter_file_frames
    from qa_worker.history import logged_chunks
    from scripts import history_fixture

    monkeypatch.setattr(history_fixture, "ROLL_S", 60.0)  # 120 frames a file at 2 fps
    video = write_sample_video(str(tmp_path / "camera.mp4"), seconds=8, fps=2, width=64, height=48)
    frames = [f.rgb for f in iter_file_frames(video, 2.0)]
    now = 1_800_000_000.0
    past = history_fixture.Past.ending(now, 2.0, 4, log_hours=0.05, index_hours=0.1)
    cams = ["cam000", "cam001"]
    done = history_fixture.prefill(tmp_path / "log", cams, video, "tiny-random", past)
    assert (done["frames_per_camera"], done["chunks_per_camera"], done["distinct_frames"]) == (360, 180, len(frames))
    assert done["log_hours"] == 0.05 and done["index_hours"] == 0.1 and done["ended_at"] == now - 0.5

    log = FrameLog(tmp_path / "log")
    span = log.span("cam001")
    assert (span.first_seq, span.last_seq, span.frames, span.files) == (360, 719, 360, 3)
    assert (span.first_ts, span.last_ts) == (now - 180.0, now - 0.5)
    assert done["log_bytes"] == log.size("cam000") + log.size("cam001")
    for rec in log.between("cam001", now - 200, now):
        msg = FrameMsg.from_rgb(rec.seq, now - (720 - rec.seq) / 2, rec.seq / 2, frames[rec.seq % len(frames)])
        assert (rec.ts, rec.raw) == (msg.ts, encode_frame(msg, codec="webp")[FIELD])

    layers, dim = history_fixture.feature_shape("tiny-random")
    index = ChunkIndex.view(tmp_path / "log" / "cam001")
    assert index is not None and (index.model, index.layers, index.dim, len(index)) == ("tiny-random", layers, dim, 180)
    rows = sorted(tuple(row[1:]) for row in index.table().tolist())
    assert rows[0][:4] == (now - 360.0, now - 358.5, 0, 3)
    logged = logged_chunks(log, "cam001", now - 180.0, now, 4)
    assert [(*c.capture_range, *c.frame_seqs, c.frames) for c in logged] == rows[90:]
    vectors = np.asarray(index.graph.get(index.table()["key"]), dtype=np.float32)
    norms = np.linalg.norm(vectors.reshape(180, len(layers), -1), axis=2)
    np.testing.assert_allclose(norms, 1.0, atol=2e-3)
    for name in (GRAPH_NAME, META_NAME):
        assert (tmp_path / "log" / "cam000" / name).read_bytes() == (tmp_path / "log" / "cam001" / name).read_bytes()


def test_the_feature_shape_is_the_engines():
    """What the fixture reads from a model's config is what the engine's vectors are made of
    (tiny-random; random-3b's is the same code on a larger config: 4 layers x 2 x 128)."""
    from common.engine.features import feature_layers
    from common.engine.model import load_model
    from common.engine.runtime import Runtime
    from scripts import history_fixture

    lm = Runtime(load_model("tiny-random")).lm
    layers = feature_layers(lm.n_layers)
    assert history_fixture.feature_shape("tiny-random") == (layers, len(layers) * lm.n_kv_heads * lm.head_dim)
    assert history_fixture.feature_shape("random-3b") == ((13, 18, 22, 27), 1024)
