"""The probes of scripts/probes/ import: they reach into the engine's internals (private helpers,
lm.py's constants, bench_engine's fixtures) that nothing else checks, so a rename there breaks them
here first. Importing runs none of them: each keeps its work under `if __name__ == "__main__"`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parents[1] / "scripts" / "probes"


def probe_files() -> list[Path]:
    return sorted(PROBES.glob("*.py"))


def test_probes_are_there() -> None:
    assert len(probe_files()) >= 14


@pytest.mark.parametrize("path", probe_files(), ids=lambda p: p.stem)
def test_probe_imports_without_running(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # argv a probe would reject: a probe that ran its main at import would exit here
    monkeypatch.setattr(sys, "argv", [str(path), "--no-such-flag"])
    monkeypatch.syspath_prepend(str(PROBES))
    spec = importlib.util.spec_from_file_location(f"probe_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
