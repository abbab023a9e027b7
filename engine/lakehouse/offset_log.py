"""Logs of small JSON files, one per round: the delayOffset checkpoint and stamping's plans.

Like Spark's own offset log (and RocketMQ's ``delayOffset.json``, without its lost updates)
each round's progress is a new file, written atomically (hidden temp file, then rename)
through Hadoop's FileSystem, so it works on local disks, HDFS and object stores alike::

    delay_offset/00000000000000000041.json       round 41, committed
    delay_offset/00000000000000000042.plan.json  round 42, planned (topic writes started)

Each file holds JSON lines with the ``DELAY_OFFSET`` schema: one line per queue. Only the
newest ``retain`` rounds are kept. SQL sees the log as the view ``<database>.delay_offset``.
Stamping plans its batches in a log of the same kind (``_checkpoints/stamp/batches``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from pyspark.sql import SparkSession

from engine.lakehouse.fs import hadoop_path, jvm, put_if_absent, read_lines

_NAME = re.compile(r"^(\d{20})(\.plan)?\.json$")


class OffsetLog:
    """Atomic JSON-lines files in one folder, addressed by round number.

    Example:
        >>> log = OffsetLog(spark, "/lake/delay_offset")  # doctest: +SKIP
        >>> log.write(7, [{"queue_id": 1, "status": "committed"}])  # doctest: +SKIP
        >>> log.latest()  # doctest: +SKIP
        (7, [{'queue_id': 1, 'status': 'committed'}], None)
    """

    def __init__(self, spark: SparkSession, path: str) -> None:
        self.spark = spark
        self.path = path
        self._made = False
        self._handles: tuple[Any, Any, Any] | None = None

    @property
    def _jvm(self) -> Any:
        return self._open()[0]

    @property
    def _dir(self) -> Any:
        return self._open()[1]

    @property
    def _fs(self) -> Any:
        return self._open()[2]

    def _open(self) -> tuple[Any, Any, Any]:
        """The JVM view, the folder and its FileSystem, looked up on first use."""
        if self._handles is None:
            folder, fs = hadoop_path(self.spark, self.path)
            self._handles = (jvm(self.spark), folder, fs)
        return self._handles

    @staticmethod
    def file_name(round_: int, planned: bool = False) -> str:
        """The file of a round: ``<20 digits>.json`` or ``<20 digits>.plan.json``."""
        return f"{round_:020d}{'.plan' if planned else ''}.json"

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
        text = "".join(json.dumps(dict(row), default=str) + "\n" for row in rows)
        if exclusive:
            location = f"{self.path.rstrip('/')}/{self.file_name(round_, planned)}"
            if not put_if_absent(self.spark, location, text.encode("utf-8")):
                raise FileExistsError(f"{location} exists")
            return
        if not self._made:
            self._fs.mkdirs(self._dir)
            self._made = True
        final = self._jvm.org.apache.hadoop.fs.Path(self._dir, self.file_name(round_, planned))
        temp = self._jvm.org.apache.hadoop.fs.Path(self._dir, f".tmp-{uuid.uuid4().hex}")
        stream = self._fs.create(temp, True)
        try:
            stream.write(bytearray(text.encode("utf-8")))
            stream.hsync()
        finally:
            stream.close()
        if self._fs.exists(final):
            self._fs.delete(final, False)
        if not self._fs.rename(temp, final):
            self._fs.delete(temp, False)
            raise OSError(f"could not rename {temp} to {final}")

    def _rounds(self) -> tuple[list[int], list[int]]:
        committed: list[int] = []
        planned: list[int] = []
        if not self._fs.exists(self._dir):
            return committed, planned
        for status in self._fs.listStatus(self._dir):
            match = _NAME.match(status.getPath().getName())
            if match:
                (planned if match.group(2) else committed).append(int(match.group(1)))
        return sorted(committed), sorted(planned)

    def read(self, round_: int, planned: bool = False) -> list[dict[str, Any]]:
        """The rows of one round's file."""
        path = self._jvm.org.apache.hadoop.fs.Path(self._dir, self.file_name(round_, planned))
        return [json.loads(line) for line in read_lines(self._jvm, self._fs, path)]

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
                self._delete(self.file_name(round_))
        for round_ in planned:
            if round_ <= keep_from:
                self._delete(self.file_name(round_, planned=True))

    def _delete(self, name: str) -> None:
        self._fs.delete(self._jvm.org.apache.hadoop.fs.Path(self._dir, name), False)
