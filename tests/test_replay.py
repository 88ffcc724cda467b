"""`streamvqa replay` end to end: a real H.264 file, the real CLI, the offline oracle."""

from __future__ import annotations

import json
import subprocess
import sys

from apps.samplevideo import write_sample_video


def replay(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "apps.cli", "replay", *args, "--model", "tiny-random", "--device", "cpu"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_replay_matches_offline_for_every_question(tmp_path):
    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=5, fps=10, width=160, height=120)
    out = replay(
        video,
        "--fps",
        "3",
        "--chunk-frames",
        "4",
        "--ask",
        "What is written on screen?",
        "--ask",
        "Which shape moves?",
        "--ask-every",
        "2",
        "--compare-offline",
        "--max-tokens",
        "10",
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert {line["trigger"] for line in lines} == {"periodic", "end"}
    assert len(lines) >= 4
    for line in lines:
        assert line["offline_match"] is True, line
        assert line["tokens"] > 0 and line["text"] == line["offline_text"]
    end = [line for line in lines if line["trigger"] == "end"]
    assert end[0]["video_time"][1] > 4.0  # 15 frames at fps 3: the last sampled at ~4.67 s
    versions = [line["version"] for line in lines]
    assert versions == sorted(versions)


def test_replay_missing_file_is_a_clear_error(tmp_path):
    out = replay(str(tmp_path / "nope.mp4"))
    assert out.returncode != 0
    assert "nope.mp4" in out.stderr


def evicting_replay(video: str, eviction: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    # 84x112 grid: 24 tokens per 4-frame chunk; ~3 chunks fit, so 8 s at fps 3 evicts several times
    out = replay(
        video, "--fps", "3", "--chunk-frames", "4", "--min-pixels", "3136", "--max-pixels", "12544",
        "--max-cache-tokens", "110", "--eviction", eviction, "--ask-every", "2", "--compare-offline",
        "--max-tokens", "10",
    )  # fmt: skip
    return out, [json.loads(line) for line in out.stdout.splitlines()]


def test_replay_with_exact_eviction_matches_offline_on_the_frames_the_cache_holds(tmp_path):
    video = write_sample_video(str(tmp_path / "clip.mp4"), seconds=8, fps=10, width=160, height=120)
    out, lines = evicting_replay(video, "exact")
    assert out.returncode == 0, out.stderr
    evicted = [line for line in lines if line["evictions"] > 0]
    assert len({line["evictions"] for line in evicted}) >= 2, lines
    for line in lines:
        assert line["offline_match"] is True and line["offline_max_logit_diff"] < 1e-4, line
        assert "offline_note" not in line
    assert all(line["video_ranges"][-1][1] == line["video_time"][1] for line in lines)
    assert evicted[-1]["video_ranges"][0][0] == 0.0 and len(evicted[-1]["video_ranges"]) == 2  # sink + recent

    out, lines = evicting_replay(video, "rebase")
    assert out.returncode == 0, out.stderr  # a difference rebase does not promise to avoid is no failure
    evicted = [line for line in lines if line["evictions"] > 0]
    assert evicted and all(line["offline_max_logit_diff"] > 1e-4 and "offline_note" in line for line in evicted)
