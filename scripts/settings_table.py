"""The README's configuration table, from the settings' declarations (`common.config.setting`):
one row per declaration, in the order the services list them, with the services that have it, its
default and its help. tests/test_readme.py keeps the README's copy equal to this.

    PYTHONPATH=. python scripts/settings_table.py
"""

from __future__ import annotations

import dataclasses
import importlib

from apps.cli import CONFIGS
from common.config import default_text

# every service's config class, as `streamvqa` loads it
ROLES = {role: getattr(importlib.import_module(module), cls) for role, (module, cls) in CONFIGS.items()}
HEADER = "| setting | services | default | meaning |\n|---|---|---|---|"


def declarations() -> list[tuple[dataclasses.Field, list[str]]]:
    """Each declaration once (a field inherited from a shared settings class is the same object in
    every service's), with the services that have it."""
    found: dict[int, tuple[dataclasses.Field, list[str]]] = {}
    for role, cls in ROLES.items():
        for f in dataclasses.fields(cls):
            found.setdefault(id(f), (f, []))[1].append(role)
    return list(found.values())


def _default(f: dataclasses.Field) -> str:
    text = default_text(f)
    return text if "shown" in f.metadata or text == "none" else f"`{text}`"


def table() -> str:
    rows = []
    for f, roles in declarations():
        services = "all" if len(roles) == len(ROLES) else ", ".join(roles)
        meaning = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{f.name}` | {services} | {_default(f)} | {meaning} |")
    return "\n".join([HEADER, *rows])


if __name__ == "__main__":
    print(table())
