"""The documentation: the site builds strictly (every link and anchor resolves), its generated config
reference holds every key, and the README's relative links point at files that exist.

The README sits outside `docs/`, so MkDocs does not check it; GitHub renders its links relative to the
repository root.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(markdown: str) -> list[str]:
    """The link targets of `markdown` that are neither URLs nor in-page anchors, without their anchors."""
    return [target.split("#")[0] for target in LINK.findall(markdown)
            if not target.startswith(("http://", "https://", "mailto:", "#"))]


def test_relative_links_are_found():
    assert relative_links("[a](docs/x.md#y) [b](https://e.org) [c](#top) ![d](docs/f.png)") == ["docs/x.md", "docs/f.png"]


def test_readme_links_point_at_files():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    targets = relative_links(readme)
    assert targets, "README.md links to nothing"
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 200, f"README.md has {len(readme)} lines; measurements and how-tos belong in docs/"
    assert any("make demo" in line for line in readme[:40]), "the two commands are not on the first screen"


def test_site_builds_strictly(tmp_path):
    if not (Path(sys.executable).parent / "mkdocs").exists():
        if os.environ.get("CI"):
            pytest.fail("CI must build the site: install the docs extra (`make install` does)")
        pytest.skip("needs the docs extra (mkdocs)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir",
                             str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    reference = (tmp_path / "site" / "config-reference" / "index.html").read_text(encoding="utf-8")
    for key in ("run.steps", "placement.max_staleness", "dynamic_sampling.max_surplus_age", "rollout.function"):
        assert f"<code>{key}</code>" in reference, key
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()
