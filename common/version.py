"""The installed streamvqa version (`streamvqa --version`, the start-up line, svqa_build_info)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("streamvqa")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


VERSION = package_version()
