"""Shoal's version, read once from the installed distribution's metadata (pyproject.toml)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    SHOAL_VERSION = version("shoal")
except PackageNotFoundError:  # running from a source tree that was never installed
    SHOAL_VERSION = "0+unknown"
