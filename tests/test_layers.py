"""The layout is the design: layers point one way and nothing imports in a circle.

apps -> services (ingest, encoder_worker, qa_worker, api) -> plumbing (common) -> wire (common.wire)
-> engine (common.engine). A service never imports another service: only apps combine them.
Also: `ruff check` and `ruff format --check` pass on the whole tree.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("ingest", "encoder_worker", "qa_worker", "api", "recorder")
PACKAGES = ("common", *SERVICES, "apps")


def layer(module: str) -> int:
    top = module.split(".")[0]
    if module.startswith("common.engine"):
        return 0
    if module.startswith("common.wire"):
        return 1
    if top == "common":
        return 2
    if top in SERVICES:
        return 3
    return 4  # apps


def project_imports() -> dict[str, set[str]]:
    """module -> project modules it imports (anywhere in the file, also inside functions)."""
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            targets: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [f"{node.module}.{a.name}" for a in node.names]
                    targets |= {n if _is_module(n) else node.module for n in names}
                elif isinstance(node, ast.Import):
                    targets |= {a.name for a in node.names}
            graph[module] = {t for t in targets if t.split(".")[0] in PACKAGES and t != module}
    return graph


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_layers_point_one_way() -> None:
    backwards = []
    for module, targets in project_imports().items():
        for target in targets:
            cross_service = layer(module) == layer(target) == 3 and module.split(".")[0] != target.split(".")[0]
            if layer(target) > layer(module) or cross_service:
                backwards.append(f"{module} -> {target}")
    assert not backwards, "imports against the layering:\n" + "\n".join(sorted(backwards))


def test_no_import_cycles() -> None:
    graph = project_imports()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target] if target in path else [module, target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_layering_check_can_fail() -> None:
    assert layer("common.engine.lm") < layer("common.wire.keys") < layer("common.redisio") < layer("qa_worker.jobs")
    assert layer("apps.cli") > layer("encoder_worker.service")


RUFF = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(args: list[str]) -> None:
    out = subprocess.run([RUFF, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
