"""Every docs page's blocks run as written, each page on a lakehouse of its own (a page is
self-contained: it makes what it needs), as a new user's plain shell at the repository root
would run them (see tests/support/readme.py for the marks a page may carry)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.lakehouse.catalog.session import REPO_ROOT
from tests.support.readme import blocks, page_env, run_page

pytestmark = pytest.mark.integration

PAGES = REPO_ROOT / "docs" / "pages"


def runnable_pages() -> list[Path]:
    """The pages with at least one block that runs."""
    return sorted(
        page
        for page in PAGES.rglob("*.md")
        if any(b.illustrative is None for b in blocks(page.read_text(encoding="utf-8")))
    )


def test_the_guides_and_operations_pages_have_blocks_that_run() -> None:
    names = {str(p.relative_to(PAGES)) for p in runnable_pages()}
    expected = {"guides/sending.md", "guides/consuming.md", "guides/cancel.md", "guides/sql.md"}
    assert expected | {"operations/running.md"} <= names, names


@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: str(p.relative_to(PAGES)))
def test_page_blocks_run_as_written(page: Path, tmp_path: Path) -> None:
    assert run_page(page, page_env(tmp_path), REPO_ROOT, tmp_path) > 0
