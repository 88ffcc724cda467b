"""The Prometheus alert rules shipped in deploy/prometheus, checked by Prometheus's own promtool
(Debian's `prometheus` package, installed by scripts/setup.sh): the rules and the scrape config
parse, each alert fires on the series it should and not on others (promtool's rule unit tests,
tests/data/prometheus-alerts.test.yml), and every metric they query is one the code exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from common import metrics

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
RULE_TESTS = REPO / "tests" / "data" / "prometheus-alerts.test.yml"
# what the issue asked to be alerted on, at least: encoder lag, drops, queue wait, a worker down
REQUIRED = {"StreamvqaEncoderLagging", "StreamvqaFramesDropped", "StreamvqaQuestionsWaiting", "StreamvqaServiceDown"}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: scripts/setup.sh installs it (Debian package prometheus)")
    return found


def run(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *map(str, args)], capture_output=True, text=True, timeout=60)


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_the_rules_and_the_scrape_config_parse(promtool):
    for args in (("check", "rules", RULES), ("check", "config", CONFIG)):
        done = run(promtool, *args)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "9 rules found" in run(promtool, "check", "rules", RULES).stdout


def test_each_alert_fires_when_it_should_and_not_otherwise(promtool):
    done = run(promtool, "test", "rules", RULE_TESTS)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == {rule["alert"] for rule in alerts()}, "every alert has a promtool test case"


def test_rules_query_only_metrics_the_code_exports():
    names = {rule["alert"] for rule in alerts()}
    assert names >= REQUIRED, REQUIRED - names
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for r in alerts() for n in re.findall(r"\bsvqa_[a-z_]+", r["expr"])}
    assert used and used <= metrics.all_names(), used - metrics.all_names()
    for rule in alerts():
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"], rule["alert"]
