"""Two processes asking for a lakehouse's SQL catalog at the same time (the metastore's race).

Each calls :func:`engine.lakehouse.catalog.metastore.catalog_conf` with a meeting point inside it:
past its claim on the metastore (taken or refused) and before it chooses, it waits until the
other is there too, so both are inside the choice at once. Then each asks again, both still
running. Run the other side as
``python -m tests.support.choosing <lakehouse> <folder> <me> <other>``: it prints its two
answers.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from engine.core.config import EngineConfig
from engine.lakehouse.catalog import metastore

CATALOG = "spark.sql.catalogImplementation"
MEET_TIMEOUT_S = 60.0


def meet(folder: Path, step: str, me: str, other: str) -> None:
    """Say that ``me`` has come to ``step``, then wait until ``other`` has come to it too."""
    (folder / f"{step}-{me}").touch()
    deadline = time.monotonic() + MEET_TIMEOUT_S
    while not (folder / f"{step}-{other}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{me}: {other} never came to {step!r}")
        time.sleep(0.005)


def choose_together(cfg: EngineConfig, folder: Path, me: str, other: str) -> tuple[str, str]:
    """The catalog chosen at the same time as ``other`` chose, and the one chosen when asked
    again (while both still run)."""
    checked = metastore.holder

    def holder(path: Path | str) -> int | None:  # called past the claim, before the choice
        meet(folder, "claimed", me, other)
        return checked(path)

    metastore.holder = holder  # type: ignore[assignment]
    try:
        first = metastore.catalog_conf(cfg)[CATALOG]
    finally:
        metastore.holder = checked  # type: ignore[assignment]
    meet(folder, "chosen", me, other)
    again = metastore.catalog_conf(cfg)[CATALOG]
    meet(folder, "asked again", me, other)  # neither ends, its claim with it, before both asked
    return first, again


if __name__ == "__main__":
    lakehouse, where, name, peer = sys.argv[1:]
    print(*choose_together(EngineConfig(lakehouse=lakehouse), Path(where), name, peer))
