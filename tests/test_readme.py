"""The README cannot rot silently: its commands and tables are checked against the code."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import redis

from api.config import ApiConfig
from apps import cli
from common.wire import keys
from common.wire.schemas import FinalAnswer, encode_delta, encode_final
from encoder_worker.config import EncoderConfig
from ingest.config import IngestConfig
from qa_worker.config import QAConfig
from recorder.config import RecorderConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    test_command = re.search(r"\*\*Test it\*\*.*?```bash\n(.+?)\n```", README, re.S).group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_command


def test_the_configuration_table_is_the_one_derived_from_the_declarations():
    """README's table equals `scripts/settings_table.py`'s output: run it and paste after a change."""
    table = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "settings_table.py")], capture_output=True, text=True, check=True
    ).stdout.strip()
    section = README[README.index("## Configuration") : README.index("## Operating it")]
    assert table in section, "the README's configuration table is out of step: run scripts/settings_table.py"
    for cls in (IngestConfig, EncoderConfig, QAConfig, ApiConfig, RecorderConfig):  # and the table holds them all
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in table, f"{cls.__name__}.{f.name} missing from the table"


def test_every_streamvqa_subcommand_in_the_readme_exists():
    used = set(re.findall(r"streamvqa (\w+)", README)) - {"on"}
    assert used <= {*cli.SERVICES, "replay"}, used - {*cli.SERVICES, "replay"}
    assert {"demo", "ask", "transcript", "status", "replay", "worker"} <= used


def test_every_metric_named_in_the_readme_is_exported():
    from common import metrics

    exported = {re.sub(r"_total$", "", n) for n in metrics.all_names()}
    named = {re.sub(r"_total$", "", n) for n in re.findall(r"`(svqa_[a-z_]+)", README)}
    assert named <= exported, named - exported


def test_the_redis_cli_example_reads_every_answer_entry_until_the_final(redis_url, redis_cli):
    """The README's redis-cli loop against a real Redis and a stand-in worker that writes each entry
    once the script waits for the next: one XREAD alone returned after the first delta."""
    section = README[README.index("## Asking questions") :]
    script = re.search(r"```bash\n(.+?)\n```", section, re.S).group(1)
    shim = f'redis-cli() {{ "{redis_cli}" -u "{redis_url}" "$@"; }}\n'  # the README's redis-cli, at this server
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    shell = subprocess.Popen(["bash", "-c", shim + script], stdout=subprocess.PIPE, text=True)
    try:
        reader = _next_reader(r, 0)
        qid = r.xrange(keys.QUESTIONS)[0][1]["id"]
        assert re.fullmatch(r"[0-9a-f]{32}", qid), "the README's question id is not random"
        final = encode_final(FinalAnswer(id=qid, stream="cam1", text="Hello\nthere"))
        for i, entry in enumerate((encode_delta("Hel"), encode_delta("lo\nthere"), final)):
            reader = _next_reader(r, reader) if i else reader
            r.xadd(keys.answer(qid), entry)
        out, _ = shell.communicate(timeout=30)
    finally:
        shell.kill()
    assert shell.returncode == 0
    assert out.count("delta") == 2 and "final" in out and "lo\nthere" in out, out


def _next_reader(r: redis.Redis, after: int, timeout_s: float = 30.0) -> int:
    """The id of a connection blocked in XREAD newer than ``after`` (each redis-cli connects anew)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ids = [int(c["id"]) for c in r.client_list() if c["cmd"] == "xread" and "b" in c["flags"]]
        if newer := [i for i in ids if i > after]:
            return max(newer)
        assert time.monotonic() < deadline, "no redis-cli waits for the next answer entry"
        time.sleep(0.02)
