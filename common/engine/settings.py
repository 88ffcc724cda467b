"""A setting's one declaration: a dataclass field holding its default and its help. The engine's
policies (SchedulePolicy, EvictionPolicy) declare theirs with it, and so do the services' config
classes (common/config.py re-exports it); flags, SVQA_* names, --help and the README's table are
derived from the declaration (scripts/settings_table.py). No torch: settings load without it."""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any, doc: str, *, shown: str | None = None, secret: bool = False) -> Any:
    """``shown``: the default as --help and the README's table give it, where the value is computed
    at import (a host name); ``secret``: never logged nor shown."""
    meta = {"help": doc} | ({"shown": shown} if shown else {}) | ({"secret": True} if secret else {})
    return dataclasses.field(default=default, metadata=meta, repr=not secret)
