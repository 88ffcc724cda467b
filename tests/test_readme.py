"""The README cannot rot silently: its commands and tables are checked against the code."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from api.config import ApiConfig
from apps import cli
from encoder_worker.config import EncoderConfig
from ingest.config import IngestConfig
from qa_worker.config import QAConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    test_command = re.search(r"\*\*Test it\*\*.*?```bash\n(.+?)\n```", README, re.S).group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == test_command


def test_every_setting_is_in_the_configuration_table():
    table = README[README.index("## Configuration") : README.index("## Operating it")]
    for cls in (IngestConfig, EncoderConfig, QAConfig, ApiConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in table, f"{cls.__name__}.{f.name} missing from the README's configuration table"


def test_every_streamvqa_subcommand_in_the_readme_exists():
    used = set(re.findall(r"streamvqa (\w+)", README)) - {"on"}
    assert used <= {*cli.SERVICES, "replay"}, used - {*cli.SERVICES, "replay"}
    assert {"demo", "ask", "transcript", "status", "replay", "worker"} <= used


def test_every_metric_named_in_the_readme_is_exported():
    from common import metrics

    exported = {re.sub(r"_total$", "", n) for n in metrics.all_names()}
    named = {re.sub(r"_total$", "", n) for n in re.findall(r"`(svqa_[a-z_]+)", README)}
    assert named <= exported, named - exported
