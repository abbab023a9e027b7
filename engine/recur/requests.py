"""Recurring schedules managed from SQL: rows inserted into ``schedule_requests``.

A running engine makes the table ``<database>.schedule_requests`` (``SCHEDULE_REQUESTS``)
and applies each row inserted into it, in commit order, as
:func:`~engine.recur.defs.create_schedule`, ``update_schedule``, ``pause_schedule``,
``resume_schedule`` or ``delete_schedule`` would::

    INSERT INTO delayq.schedule_requests (name, action, topic, body, cron, time_zone)
    VALUES ('nightly', 'create', 'reports', 'build the report', '30 2 * * *', 'Europe/Berlin')

Each request gets an outcome in ``<database>.schedule_request_results``: ``applied`` with
the revision it made, or ``refused`` with why (the same words as the command line's).

Exactly once: the requests of one ``schedule_requests`` version are decided together,
their outcomes and revisions written first (``_checkpoints/schedule-requests``, the
revisions as a Parquet file the outcomes name, in ``schedule-requests-revisions``), then
appended to ``recurring`` in one
commit recording the version (a Delta ``txn``), then the version is marked applied. An
engine killed between two of these finds the decision and writes only what is missing.

Example:
    >>> ScheduleRequests(cfg, clock, fence=lease.check).apply()  # doctest: +SKIP
    1
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import pyarrow.parquet as pq
from pyspark.sql.pandas.types import to_arrow_schema

from engine.core.clock import Clock, SystemClock
from engine.core.config import EngineConfig
from engine.core.errors import CheckpointError, ConfigError, InvalidMessageError, ScheduleError
from engine.lakehouse.delta.appends import CommitlogSource
from engine.lakehouse.delta.arrow_delta import ArrowDelta, create_table
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.state.lease import unfenced
from engine.lakehouse.state.offset_log import OffsetLog
from engine.lakehouse.storage.layout import layout
from engine.recur.defs import (
    RecurringSchedule,
    read_schedules,
    recurring_table,
    revise,
    revision_rows,
)
from schemas import SCHEDULE_REQUESTS

log = logging.getLogger(__name__)

#: The ``txn`` app id of the ``recurring`` commits that apply SQL requests.
REQUESTS_APP = "delayq-schedule-requests"
#: ``schedule_requests`` columns and the schedule fields they give (others: as named).
_FIELDS = {"start_ts": "start", "end_ts": "end"}
_NOT_FIELDS = ("name", "action", "requested_ts")


def requests_table(cfg: EngineConfig) -> ArrowDelta:
    """The ``schedule_requests`` table, made if missing (no Spark job)."""
    path = layout(cfg).schedule_requests
    create_table(path, to_arrow_schema(SCHEDULE_REQUESTS, timezone="UTC"))
    return ArrowDelta(path)


def request_spec(row: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A request row as an action and the fields it gives (null columns left out).

    Example:
        >>> request_spec({"name": "n", "action": " Pause ", "topic": None})
        ('pause', {'name': 'n'})
    """
    spec: dict[str, Any] = {"name": row.get("name")}
    for column, value in row.items():
        if column in _NOT_FIELDS or value is None:
            continue
        if column == "properties":
            value = dict(value)
        spec[_FIELDS.get(column, column)] = value
    return str(row.get("action") or "").strip().lower(), spec


def decide(
    cfg: EngineConfig,
    current: Mapping[str, RecurringSchedule],
    rows: list[dict[str, Any]],
    now: datetime,
) -> tuple[list[dict[str, Any]], list[RecurringSchedule]]:
    """The outcome of each request, in order, and the revisions the applied ones make (a
    request sees the ones before it); writes nothing.

    Example:
        >>> pause = [{"name": "n", "action": "pause"}]
        >>> outcomes, made = decide(cfg, {}, pause, now)  # doctest: +SKIP
        >>> outcomes[0]["result"], outcomes[0]["detail"]  # doctest: +SKIP
        ('refused', "invalid schedule name='n': no such schedule")
    """
    known = dict(current)
    outcomes: list[dict[str, Any]] = []
    made: list[RecurringSchedule] = []
    for i, row in enumerate(rows):
        action, spec = request_spec(row)
        outcome: dict[str, Any] = {
            "row": i, "name": row.get("name"), "action": action, "decided_ts": now.isoformat(),
        }  # fmt: skip
        try:
            schedule = revise(cfg, known, action, spec, now)
        except (ScheduleError, InvalidMessageError, ConfigError) as err:
            outcomes.append({**outcome, "result": "refused", "revision": None, "detail": str(err)})
            continue
        except Exception as err:  # (a value no check foresaw: refused all the same)
            why = f"{type(err).__name__}: {err}"
            outcomes.append({**outcome, "result": "refused", "revision": None, "detail": why})
            continue
        known[schedule.name] = schedule
        made.append(schedule)
        outcomes.append({**outcome, "result": "applied", "revision": schedule.revision,
                         "detail": None})  # fmt: skip
    return outcomes, made


class ScheduleRequests:
    """Applies the rows inserted into ``schedule_requests``, each version once.

    Args:
        cfg: engine configuration.
        clock: the time changes take effect (their revisions' ``effective_ts``).
        fence: raises once this engine no longer holds the lakehouse (checked before each
            write to ``recurring``).
        applied: called after a version's requests were applied (the catalog names the
            results view then).
    """

    def __init__(
        self,
        cfg: EngineConfig,
        clock: Clock | None = None,
        *,
        fence: Callable[[], None] = unfenced,
        applied: Callable[[], object] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.fence = fence
        self._applied_hook = applied
        self.layout = layout(cfg)
        self.log = OffsetLog(self.layout.checkpoint("schedule-requests"))
        self.revisions = self.layout.checkpoint("schedule-requests-revisions")
        self._done: int | None = None  # the newest version applied
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget what was applied (another engine may have applied requests meanwhile)."""
        with self._lock:
            self._done = None

    def apply(self) -> int:
        """Apply the requests of every version not applied yet; how many were decided.

        Example:
            >>> requests.apply()  # doctest: +SKIP
            2
        """
        with self._lock:
            table = ArrowDelta(self.layout.schedule_requests)
            latest = table.latest()
            if latest < 0:
                return 0
            if self._done is None:
                self._done = self.log.latest()[0]
                self._done = -1 if self._done is None else self._done
            decided = 0
            for version in range(self._done + 1, latest + 1):
                decided += self._apply(version)
                self._done = version
            if decided:
                self._applied_hook()
            return decided

    def _apply(self, version: int) -> int:
        try:
            outcomes = self.log.read(version, planned=True)
        except FileNotFoundError:
            outcomes = self._decide(version)
        made = [o for o in outcomes if o["result"] == "applied"]
        if made:
            recurring = recurring_table(self.cfg)
            recorded = recurring.txn_version(REQUESTS_APP)
            if (recorded is None or recorded < version) and self._stale(made):
                # Decided before a restart, not appended, and the schedules changed since
                # (their revisions would collide): decided again, the decision replaced.
                outcomes = self._decide(version, again=True)
                made = [o for o in outcomes if o["result"] == "applied"]
            if made and (recorded is None or recorded < version):
                path = f"{self.revisions}/{made[0]['file']}"
                rows = pq.read_table(
                    self.log.store.arrow_path(path), filesystem=self.log.store.filesystem
                )
                self.fence()
                recurring.append(rows.cast(recurring.schema()), txn=Txn(REQUESTS_APP, version))
        self.fence()
        applied = [{**o, "status": "applied"} for o in outcomes]
        with contextlib.suppress(FileExistsError):  # (applied already, before a restart)
            self.log.write(version, applied, exclusive=True)
        for o in outcomes:
            if o["result"] == "refused":
                log.warning(
                    "schedule request %s %s refused: %s", o["action"], o["name"], o["detail"]
                )
        return len(outcomes)

    def _stale(self, made: list[dict[str, Any]]) -> bool:
        """Whether a schedule a decision changes has a revision it did not see."""
        current = read_schedules(recurring_table(self.cfg))
        return any(
            o["name"] in current and current[o["name"]].revision >= int(o["revision"]) for o in made
        )

    def _decide(self, version: int, again: bool = False) -> list[dict[str, Any]]:
        """Decide a version's requests and write the decision (put-if-absent; ``again``:
        replacing one that was never appended)."""
        source = CommitlogSource(self.layout.schedule_requests)
        now = self.clock.now()
        try:
            rows = source.read(source.files(version)).to_pylist()
        except (CheckpointError, FileNotFoundError) as err:  # (not an append, or gone)
            ignored = {
                "row": None, "name": None, "action": None, "decided_ts": now.isoformat(),
                "result": "ignored", "revision": None, "detail": str(err), "version": version,
                "file": None, "status": "decided",
            }  # fmt: skip
            rows, outcomes = [], [ignored]
        else:
            outcomes = []
        decided, made = decide(self.cfg, read_schedules(recurring_table(self.cfg)), rows, now)
        outcomes += decided
        name = f"{version:020d}-{uuid.uuid4().hex[:12]}.parquet"
        for o in decided:
            o["version"], o["file"], o["status"] = version, name if made else None, "decided"
        if made:
            schema = recurring_table(self.cfg).schema()
            self.log.store.write_parquet(f"{self.revisions}/{name}", revision_rows(made, schema))
        self.fence()
        try:
            self.log.write(version, outcomes, planned=True, exclusive=not again)
        except FileExistsError:
            return self.log.read(version, planned=True)  # (decided before: that decision)
        return outcomes


__all__ = ["REQUESTS_APP", "ScheduleRequests", "decide", "request_spec", "requests_table"]
