"""``make help`` lists every target the Makefile describes (a name with a digit, s3-up, was
once left out by the listing's pattern)."""

from __future__ import annotations

import re
import subprocess

from engine.lakehouse.catalog.session import REPO_ROOT


def test_make_help_lists_every_described_target() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    described = re.findall(r"^([^\s:#=]+):[^=\n]*## ", makefile, flags=re.MULTILINE)
    shown = subprocess.run(
        ["make", "-s", "help"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    listed = re.findall(r"^  make (\S+)", shown, flags=re.MULTILINE)
    assert "s3-up" in described and "lint" in described
    assert listed == described, set(described) ^ set(listed)
