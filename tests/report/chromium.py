"""Opening an HTML file in Debian's headless Chromium: the DOM after scripts ran, console messages, a screenshot.

Only the `chromium` executable on PATH is used (`apt-get install chromium`; .ci/run installs it),
never a browser downloader. Under `CI=true` a missing browser fails the test instead of skipping it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

TIMEOUT_S = 120
VIRTUAL_TIME_MS = 10_000
"""Virtual time the page gets to run its scripts (Chromium fast-forwards timers; the wall time is shorter)."""
_CONSOLE = re.compile(r":CONSOLE(?:\(\d+\))?:?\d*\]\s*(.*)")


@dataclass
class Rendered:
    dom: str
    """The document after its scripts ran (`--dump-dom`)."""
    console: list[str]
    """Every message the page wrote to the console (errors, uncaught exceptions, logs)."""


def chromium_or_skip() -> str:
    """The chromium executable; pytest.fail under CI=true when there is none, else skip."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    message = "no `chromium` on PATH (Debian: apt-get install -y chromium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; CI must run the browser test")
    pytest.skip(message)


def _run(chromium: str, url: str, *flags: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--mute-audio",
                   f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                   f"--virtual-time-budget={VIRTUAL_TIME_MS}", *flags, url]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def render(chromium: str, page: Path) -> Rendered:
    """Load `page` and return its final DOM with the console messages."""
    proc = _run(chromium, page.resolve().as_uri(), "--dump-dom")
    console = [m.group(1) for line in proc.stderr.splitlines() if (m := _CONSOLE.search(line))]
    return Rendered(dom=proc.stdout, console=console)


def screenshot(chromium: str, page: Path, png: Path, width: int = 1400, height: int = 3600) -> Path:
    """A PNG of the page's top `height` pixels at `width` pixels wide."""
    _run(chromium, page.resolve().as_uri(), f"--window-size={width},{height}", f"--screenshot={png}",
         "--hide-scrollbars")
    assert png.is_file() and png.stat().st_size > 10_000, f"no screenshot written to {png}"
    return png
