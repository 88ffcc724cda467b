"""Commands that run no model never import torch, so they start at once (`streamvqa ask` used to
spend 7 s importing it for a 0.5 s answer)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from common.version import VERSION

# Runs a command in-process, then reports which heavy modules it pulled in.
PROBE = """
import json, sys
from apps import cli
try:
    rc = cli.main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["status", "--json"],
        ["transcript", "--stream", "cam1", "--format", "json"],
        ["ask", "--stream", "cam1", "--timeout", "0.5", "hello"],  # nobody answers: times out, exit 1
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_tools_do_not_import_torch(argv, redis_url):
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv, "--redis-url", redis_url], capture_output=True, text=True, timeout=60
    )
    wall = time.monotonic() - t0
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [], out.stderr
    assert report["rc"] in (0, 1), out.stderr
    # Under a second on an idle machine; the bound leaves room for a loaded CI box, while
    # importing torch alone takes longer than that.
    assert wall < 5, wall


def test_version():
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == f"streamvqa {VERSION}"
    assert VERSION != "0+unknown"  # the package is installed (make test installs it)


@pytest.mark.parametrize("password", ["Pw#s3cret", "Pw/s3cret", "Pw?s3cret", "Pw@s3cret"])
@pytest.mark.parametrize("command", [["status"], ["ask", "--stream", "cam1", "--timeout", "0.5", "hi"]])
def test_a_password_with_url_delimiters_is_never_shown(command, password, redis_url):
    """An unescaped '#', '/', '?' or '@' in a password ends the URL's userinfo early for a URL
    parser: the redaction missed the rest of it, and the config check quoted the parser's error
    ("Port could not be cast to integer value as 'Pw'")."""
    url = redis_url.replace("redis://", f"redis://:{password}@")
    out = subprocess.run(
        [sys.executable, "-m", "apps.cli", *command, "--redis-url", url], capture_output=True, text=True, timeout=60
    )
    assert out.returncode in (0, 1, 2, 3), out.stderr
    for piece in ("Pw", "s3cret"):
        assert piece not in out.stdout + out.stderr, out.stdout + out.stderr
