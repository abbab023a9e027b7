"""One consumer group's commits in ``consumer_log``, followed and appended from the driver.

A polling consumer used to commit with Spark jobs: a DataFrame of its positions and failed
messages, the failed messages' topic rows read back, the append, a read to check that its
commit won, a read and an append to forward the send-backs to ``commitlog``, and a full read
of ``consumer_log`` whenever another member of the group committed. That is about 2.5 s per
batch on a small machine, most of a ``SimpleConsumer``'s time. :class:`GroupLog` does the
same with Arrow: it follows ``consumer_log`` commit by commit
(:class:`~engine.lakehouse.delta.live_files.LiveFiles`), folding only the new files into the
group's state (its last commit number, its position per table, the recent commits' ids),
and appends a commit or a send-back with :class:`~engine.lakehouse.delta.arrow_delta.ArrowDelta`
under the same ``txnAppId``/``txnVersion`` the Spark writers use, so both kinds of writer
see each other's commits and neither writes one twice.

Example:
    >>> log = GroupLog(cfg, "billing", POLL)  # doctest: +SKIP
    >>> log.refresh()  # doctest: +SKIP
    >>> log.seq, log.positions  # doctest: +SKIP
    (12, {'orders': (41, 1790000000000000, 'M7')})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from engine.core.clock import epoch_micros
from engine.core.config import EngineConfig
from engine.lakehouse.delta.arrow_delta import ArrowDelta
from engine.lakehouse.delta.delta_log import Txn
from engine.lakehouse.delta.live_files import LiveFiles
from engine.lakehouse.storage.layout import layout

#: A position in a topic table: (delivery round, deliver time in epoch µs, message id).
Position = tuple[int, int, str]
#: Commit ids kept to answer :meth:`GroupLog.commit_id` (the latest commits').
KEPT_IDS = 256
_STATE_COLUMNS = [
    "commit_seq", "commit_id", "kind", "topic", "delivery_round", "deliver_ts", "msg_id"
]  # fmt: skip


def commit_app_id(group: str, mode: str) -> str:
    """The ``txnAppId`` of a group's commits in ``consumer_log`` (their number is the
    ``txnVersion``).

    Example:
        >>> commit_app_id("billing", "poll")
        'delayq-group-poll-billing'
    """
    return f"delayq-group-{mode}-{group}"


def sendback_app_id(group: str, mode: str, log_id: str) -> str:
    """The ``txnAppId`` of a group's send-backs in ``commitlog``; ``log_id`` names the
    ``consumer_log`` table, so a log made anew does not collide with the old one's numbers.

    Example:
        >>> sendback_app_id("billing", "poll", "8c1d")
        'delayq-sendback-poll-billing-8c1d'
    """
    return f"delayq-sendback-{mode}-{group}-{log_id}"


class GroupLog:
    """A group's state in ``consumer_log`` and its appends there; not thread-safe.

    Args:
        cfg: engine configuration (the lakehouse).
        group: the group's name, as its commits record it.
        mode: ``poll`` or ``stream`` (:mod:`engine.consume.commit_log`).

    Attributes:
        version: the ``consumer_log`` version the state is as of (-1: not read yet).
        seq: the group's last commit number (-1: none).
        positions: per topic table, the furthest position a commit recorded.
    """

    def __init__(self, cfg: EngineConfig, group: str, mode: str) -> None:
        lay = layout(cfg)
        self.group = group
        self.mode = mode
        self._files = LiveFiles(lay.consumer_log)
        self._log = ArrowDelta(lay.consumer_log)
        self._commitlog = ArrowDelta(lay.commitlog)
        self.version = -1
        self.seq = -1
        self.positions: dict[str, Position] = {}
        self._ids: dict[int, str] = {}
        self._sent: dict[int, int] = {}  # commit -> its send-backs, for the kept ids

    def latest(self) -> int:
        """The latest ``consumer_log`` version (a probe of the next log file)."""
        return self._files.latest()

    def refresh(self) -> bool:
        """Fold the commits made since the last refresh into the state.

        Returns:
            Whether the table had new commits (of this group or another).
        """
        version = self._files.latest()
        if version == self.version:
            return False
        if version < self.version:  # the table was made anew
            self._files.reset()
            self.seq, self.positions, self._ids, self._sent = -1, {}, {}, {}
        mine = (ds.field("group_name") == self.group) & (ds.field("mode") == self.mode)
        # Files already folded are retired below, so the dataset holds the new ones (or
        # every file, when LiveFiles read the table's state again: folding is idempotent).
        rows = self._files.dataset(version).to_table(columns=_STATE_COLUMNS, filter=mine)
        self._files.retire(version, done=lambda _f: True)
        self.version = version
        self._fold(rows)
        return True

    def _fold(self, rows: pa.Table) -> None:
        if rows.num_rows == 0:
            return
        top = pc.max(rows["commit_seq"]).as_py()
        if top is not None:
            self.seq = max(self.seq, int(top))
        sent: dict[int, int] = {}
        for r in rows.select(["commit_seq", "commit_id", "kind"]).drop_null().to_pylist():
            seq = int(r["commit_seq"])
            # The first commit of a number wins (files come in commit order), as Delta's
            # txn check makes it for writers that race through delta-rs.
            self._ids.setdefault(seq, str(r["commit_id"]))
            sent[seq] = sent.get(seq, 0) + (r["kind"] in ("retry", "dead"))
        for seq, count in sent.items():  # rows folded again (a compaction) count once
            self._sent[seq] = max(self._sent.get(seq, 0), count)
        for old in sorted(self._ids)[:-KEPT_IDS]:
            del self._ids[old]
            self._sent.pop(old, None)
        offsets = rows.filter(pc.equal(rows["kind"], "offset"))
        micros = epoch_micros(offsets["deliver_ts"])
        for table, round_, us, msg_id in zip(
            offsets["topic"].to_pylist(),
            offsets["delivery_round"].to_pylist(),
            micros.to_pylist(),
            offsets["msg_id"].to_pylist(),
            strict=True,
        ):
            if table is None or round_ is None or us is None or msg_id is None:
                continue  # Spark's max(struct) puts a null field first, never past a position
            position = (int(round_), int(us), str(msg_id))
            if table not in self.positions or position > self.positions[table]:
                self.positions[table] = position

    def commit_id(self, seq: int) -> str | None:
        """The id of the group's commit ``seq`` as recorded (after :meth:`refresh`)."""
        return self._ids.get(seq)

    def committed(self, seq: int) -> bool:
        """Whether commit ``seq`` of the group is recorded (its ``txnVersion``)."""
        recorded = self._log.txn_version(commit_app_id(self.group, self.mode))
        return recorded is not None and recorded >= seq

    def append(self, rows: Sequence[dict[str, Any]], seq: int, metadata: str) -> bool:
        """Append commit ``seq`` (rows shaped as ``consumer_log``'s), unless a commit with
        that number is recorded already (by another member, or by this one before).

        Returns:
            Whether this call wrote it (the caller checks :meth:`commit_id` either way:
            another member's append may have won the race for the same number).
        """
        if self.committed(seq):
            return False
        table = pa.Table.from_pylist(list(rows), schema=self._log.schema())
        self._log.append(
            table, txn=Txn(commit_app_id(self.group, self.mode), seq), metadata=metadata
        )
        return True

    def sendbacks(self, seq: int) -> pa.Table:
        """The ``commitlog`` rows commit ``seq`` sends back (a read of the latest version)."""
        latest = self._log.latest()
        if latest < 0:
            return pa.table({})
        wanted = (
            (ds.field("group_name") == self.group)
            & (ds.field("mode") == self.mode)
            & (ds.field("commit_seq") == seq)
            & ds.field("kind").isin(["retry", "dead"])
        )
        found = self._log.dataset(latest).to_table(columns=["sendback"], filter=wanted)
        return pa.Table.from_struct_array(found["sendback"].combine_chunks())

    def forward(self, seq: int, log_id: str, rows: Sequence[dict[str, Any]] | None = None) -> int:
        """Send commit ``seq``'s failed messages to ``commitlog``, once.

        Args:
            seq: the commit.
            log_id: ``consumer_log``'s table id (:func:`sendback_app_id`).
            rows: the send-backs as ``commitlog`` rows, if the caller holds them (else they
                are read from the commit, when it has any).

        Returns:
            How many rows the commit sends back (sent now or before); -1 when it is not
            known without reading them (they were sent before).
        """
        count = len(rows) if rows is not None else self._sent.get(seq)
        if count == 0:
            return 0
        app_id = sendback_app_id(self.group, self.mode, log_id)
        recorded = self._commitlog.txn_version(app_id)
        if recorded is not None and recorded >= seq:
            return -1 if count is None else count
        table = (
            self.sendbacks(seq)
            if rows is None
            else pa.Table.from_pylist(list(rows), schema=self._commitlog.schema())
        )
        if table.num_rows:
            self._commitlog.append(
                table,
                txn=Txn(app_id, seq),
                metadata=f"delayq {self.mode} consumer {self.group} commit {seq}",
            )
        return int(table.num_rows)


__all__ = ["GroupLog", "Position", "commit_app_id", "sendback_app_id"]
