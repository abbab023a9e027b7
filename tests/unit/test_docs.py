"""The docs site builds in strict mode (a broken link, an anchor that does not exist or a
page left out of the navigation fails it), and its reference pages are made from the code:
every configuration key, every command, every table."""

from __future__ import annotations

import html
import os
import subprocess
import sys
from pathlib import Path

from engine.core.config import GROUP_KEYS, KEYS
from engine.core.reference import MEANINGS, PATTERNS, settings
from engine.lakehouse.catalog.session import REPO_ROOT


def test_every_configuration_key_has_its_meaning_and_no_meaning_is_of_an_unknown_key() -> None:
    keys = {*KEYS, *(f"consumers.{k}" for k in GROUP_KEYS), *PATTERNS}
    assert set(MEANINGS) == keys, set(MEANINGS) ^ keys
    assert [s.key for s in settings()].count("lease.timeout") == 1


def test_the_docs_site_builds_strictly_with_the_reference_made_from_the_code(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(REPO_ROOT / "docs" / "mkdocs.yml"), "--site-dir", str(site)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # (Material's notice of its end)
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    configuration = (site / "reference" / "configuration" / "index.html").read_text()
    missing = [s.key for s in settings() if html.escape(s.key) not in configuration]
    assert not missing, f"keys missing from the configuration page: {missing}"
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("send", "run", "status", "cancel", "maintain", "dlq"):
        assert f"delayq {command}" in cli, command
    tables = (site / "reference" / "tables" / "index.html").read_text()
    for table, column in (("schedule", "deliver_ts"), ("commitlog", "delay_level")):
        assert f"<code>{table}</code>" in tables and f"<code>{column}</code>" in tables
