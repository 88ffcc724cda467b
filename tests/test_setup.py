"""scripts/setup.sh and the package build: a second run does nothing and says nothing, a changed
pyproject.toml installs again, and building the package gives no setuptools warning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fake_tools(root: Path) -> tuple[Path, Path]:
    """A virtual environment whose python and pip only log their arguments (torch "installed"),
    and a dpkg that finds every Debian package: setup.sh runs for real, nothing is installed."""
    log, bin_dir, venv_bin = root / "calls.log", root / "bin", root / "venv" / "bin"
    for d in (bin_dir, venv_bin):
        d.mkdir(parents=True)
    for tool in (venv_bin / "python", venv_bin / "pip", bin_dir / "dpkg"):
        tool.write_text(f'#!/bin/sh\necho "{tool.name} $*" >> {log}\n')
        tool.chmod(0o755)
    return log, root / "venv"


def run_setup(repo: Path, venv: Path, path: str, *profile: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "HOME": str(repo), "VENV": str(venv)}
    cmd = ["bash", "scripts/setup.sh", *profile]
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=60)


def test_the_demo_setup_asks_for_no_test_server_or_browser_and_a_test_setup_serves_it(tmp_path):
    """`make demo` installed the tests' Debian packages (chromium, mosquitto, prometheus, redis-server
    and GStreamer, some starting system daemons): found by a newcomer's first hour."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    log, venv = fake_tools(tmp_path / "tools")
    path = f"{tmp_path / 'tools' / 'bin'}:/usr/bin:/bin"
    assert run_setup(repo, venv, path, "demo").returncode == 0
    looked_at = [c.split()[-1] for c in log.read_text().splitlines() if c.startswith("dpkg -s ")]
    assert looked_at == ["python3-venv"] and "pip install -q -e .[demo]" in log.read_text()
    assert run_setup(repo, venv, path).returncode == 0
    assert "pip install -q -e .[test,demo]" in log.read_text()
    log.write_text("")
    again = run_setup(repo, venv, path, "demo")
    assert again.returncode == 0 and "pip" not in log.read_text(), "a test set-up serves the demo"
    assert run_setup(repo, venv, path, "nonsense").returncode == 2


def test_a_second_setup_skips_what_is_done_quietly(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    log, venv = fake_tools(tmp_path / "tools")
    path = f"{tmp_path / 'tools' / 'bin'}:/usr/bin:/bin"  # no nvidia-smi: the CPU branch
    first = run_setup(repo, venv, path)
    assert first.returncode == 0, first.stderr
    assert "pip install -q -e .[test,demo]" in log.read_text()
    log.write_text("")
    second = run_setup(repo, venv, path)
    assert second.returncode == 0 and second.stdout == second.stderr == "", second
    calls = log.read_text().splitlines()
    assert calls and all(c.startswith("dpkg -s ") for c in calls), "only the Debian packages looked at, again"
    with (repo / "pyproject.toml").open("a") as f:
        f.write("\n# a changed dependency\n")
    assert run_setup(repo, venv, path).returncode == 0
    assert "pip install -q -e .[test,demo]" in log.read_text(), "a changed pyproject.toml installs again"


def test_the_package_builds_without_setuptools_warnings(tmp_path):
    """Every package directory is declared (api.web, the page, was not: a 45-line warning at
    every install), and the page ships in the wheel."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".*", "tests", "docs", "build", "*.egg-info", "deploy"))
    out = tmp_path / "dist"
    out.mkdir()
    build = "from setuptools import build_meta as b; import sys; b.build_wheel(sys.argv[1])"
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    done = subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "_Warning" not in done.stderr and "absent from the `packages`" not in done.stderr, done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"api/web/index.html", "api/web/app.js", "api/web/style.css"} <= set(names)
