"""Logs of small JSON files, one per round: the delayOffset checkpoint and stamping's plans.

Like Spark's own offset log (and RocketMQ's ``delayOffset.json``, without its lost updates)
each round's progress is a new file, written whole (put-if-absent for plans and commits)
through the lakehouse's :mod:`~engine.lakehouse.storage.store`, a local folder or S3 alike::

    delay_offset/00000000000000000041.json       round 41, committed
    delay_offset/00000000000000000042.plan.json  round 42, planned (topic writes started)

Each file holds JSON lines with the ``DELAY_OFFSET`` schema: one line per queue. Only the
newest ``retain`` rounds are kept. SQL sees the log as the view ``<database>.delay_offset``.
Stamping plans its batches in a log of the same kind (``_checkpoints/stamp/batches``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from engine.lakehouse.storage.location import store_for
from engine.lakehouse.storage.store import Store

_NAME = re.compile(r"^(\d{20})(\.plan)?\.json$")


class OffsetLog:
    """Atomic JSON-lines files in one folder, addressed by round number.

    Example:
        >>> log = OffsetLog("/lake/delay_offset")  # doctest: +SKIP
        >>> log.write(7, [{"queue_id": 1, "status": "committed"}])  # doctest: +SKIP
        >>> log.latest()  # doctest: +SKIP
        (7, [{'queue_id': 1, 'status': 'committed'}], None)
    """

    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/")
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        """The store holding the log, looked up on first use."""
        if self._store is None:
            self._store = store_for(self.path)
        return self._store

    @staticmethod
    def file_name(round_: int, planned: bool = False) -> str:
        """The file of a round: ``<20 digits>.json`` or ``<20 digits>.plan.json``."""
        return f"{round_:020d}{'.plan' if planned else ''}.json"

    def _location(self, round_: int, planned: bool = False) -> str:
        return f"{self.path}/{self.file_name(round_, planned)}"

    def write(
        self,
        round_: int,
        rows: Iterable[Mapping[str, Any]],
        planned: bool = False,
        exclusive: bool = False,
    ) -> None:
        """Write one round's rows atomically; an existing file of that name is replaced,
        unless ``exclusive`` (put-if-absent: of two writers of one round, one fails).

        Raises:
            FileExistsError: ``exclusive`` and the round's file exists (another writer).
        """
        data = "".join(json.dumps(dict(row), default=str) + "\n" for row in rows).encode()
        location = self._location(round_, planned)
        if exclusive:
            if not self.store.create(location, data):
                raise FileExistsError(f"{location} exists")
            return
        self.store.write(location, data)

    def _rounds(self) -> tuple[list[int], list[int]]:
        committed: list[int] = []
        planned: list[int] = []
        for name in self.store.names(self.path):
            match = _NAME.match(name)
            if match:
                (planned if match.group(2) else committed).append(int(match.group(1)))
        return sorted(committed), sorted(planned)

    def read(self, round_: int, planned: bool = False) -> list[dict[str, Any]]:
        """The rows of one round's file.

        Raises:
            FileNotFoundError: the round has no such file.
        """
        data = self.store.read(self._location(round_, planned))
        if data is None:
            raise FileNotFoundError(self._location(round_, planned))
        return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]

    def latest(self) -> tuple[int | None, list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The newest committed round and its rows, and a newer plan's rows if any."""
        committed, planned = self._rounds()
        last = committed[-1] if committed else None
        rows = self.read(last) if last is not None else []
        newer = [p for p in planned if last is None or p > last]
        plan = self.read(newer[-1], planned=True) if newer else None
        return last, rows, plan

    def purge(self, keep_from: int) -> None:
        """Delete committed rounds below ``keep_from`` and plans at or below it."""
        committed, planned = self._rounds()
        for round_ in committed:
            if round_ < keep_from:
                self.store.delete(self._location(round_))
        for round_ in planned:
            if round_ <= keep_from:
                self.store.delete(self._location(round_, planned=True))
