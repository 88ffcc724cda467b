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
