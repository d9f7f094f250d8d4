"""Headless Chromium for the dashboard's tests: Debian's `chromium`, driven by Playwright.

Playwright never downloads a browser here: it launches the system's executable. Where
either is missing the tests that need a browser are skipped, saying which is missing
(`.ci/run` installs the browser, so CI runs them).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
LAUNCH_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1440, "height": 1000}


def chromium_executable() -> str:
    """The system Chromium's path; skips the test (with the reason) when there is none, or
    when the playwright package is missing."""
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("the playwright package is not installed (pip install -e '.[dev]')")
    for candidate in CHROMIUM_CANDIDATES:
        if Path(candidate).is_file():
            return candidate
    found = shutil.which("chromium")
    if found is None:
        pytest.skip("no Chromium on this machine: apt-get install chromium (Debian's package; .ci/run does it)")
    return found
