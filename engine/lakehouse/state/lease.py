"""One engine per lakehouse: a lease with a fencing epoch.

An engine holds its lakehouse through small files in ``<lakehouse>/_engine/lease/``::

    00000000000000000003.json       epoch 3's claim: engine id, host, pid, since when
    00000000000000000003.beat.json  its latest renewal, and whether it was released

To start, an engine reads the newest claim. If that holder renewed within
``lease.timeout`` and has not released the lakehouse, the engine refuses to start, naming
it (or, with ``lease.standby``, waits until it stops or its lease runs out). Otherwise it
claims the next epoch by creating that claim file put-if-absent, so of two engines started
together exactly one gets it. A holder on this machine whose process is gone (``kill -9``)
has no lease left: a restart takes over at once.

The epoch fences: before an engine plans or commits a round (or plans a stamping batch) it
checks that its epoch is still the newest, and stops with :class:`FencedError` once another
engine has claimed a later one (it was paused past its lease, or cut off from the store).
The round files themselves are created put-if-absent, so even an engine paused between that
check and its write cannot commit a round another engine committed: its write fails.

Example:
    >>> lease = Lease("/lake", SystemClock(), timeout_ms=15_000)  # doctest: +SKIP
    >>> lease.acquire().epoch                                           # doctest: +SKIP
    1
    >>> lease.check()                                                   # doctest: +SKIP
    >>> lease.release()                                                 # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime

from engine.core.clock import Clock
from engine.core.errors import FencedError, LakehouseHeldError
from engine.core.processes import alive, machine_key, started
from engine.lakehouse.storage.fs import (
    delete_file,
    list_files,
    put_if_absent,
    read_text,
    write_text,
)

log = logging.getLogger("delayq")

LEASE_DIR = "_engine/lease"
_CLAIM = re.compile(r"^(\d{20})\.json$")
KEEP_EPOCHS = 20  # older claims are deleted when a new one is made
STANDBY_POLL_S = 1.0


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lakehouse: one epoch's claim and its latest renewal.

    Attributes:
        epoch: the claim's number; the newest claim holds the lakehouse.
        engine_id: a random id of the engine object that made the claim.
        host: the machine it runs on.
        pid: its process id there.
        since_ms: when it claimed the lakehouse (epoch milliseconds, its clock).
        renewed_ms: when it last renewed its lease.
        timeout_ms: how long the lease lasts without a renewal.
        released: whether it let the lakehouse go (a clean stop).
        machine: its machine and pid namespace (:func:`~engine.core.processes.machine_key`).
        pid_start: when its process started (with ``pid``, one process even if reused).
    """

    epoch: int
    engine_id: str
    host: str
    pid: int
    since_ms: int
    renewed_ms: int
    timeout_ms: int
    released: bool = False
    machine: str = ""
    pid_start: int = 0

    def lapsed(self, now_ms: int) -> bool:
        """Whether the lease is over: released, not renewed in time, or its process is gone
        from this machine.

        Example:
            >>> Holder(1, "e", "h", 0, 0, 1_000, 15_000).lapsed(10_000)
            False
            >>> Holder(1, "e", "h", 0, 0, 1_000, 15_000).lapsed(17_000)
            True
        """
        if self.released or now_ms - self.renewed_ms > self.timeout_ms:
            return True
        return not self.may_still_run()

    def may_still_run(self) -> bool:
        """Whether the engine that made this claim may still be running (a stalled one, past
        its lease): it did not release it, and its process is on another machine or still
        alive on this one.

        Example:
            >>> Holder(1, "e", "h", 0, 0, 1_000, 15_000, released=True).may_still_run()
            False
        """
        if self.released:
            return False
        if self.machine != machine_key():
            return True  # another machine: only its renewals tell
        return alive(self.pid) and started(self.pid) == self.pid_start

    def describe(self, now_ms: int) -> str:
        """``host H, pid P, since <UTC time> (epoch E, renewed 1.2 s ago)``.

        Example:
            >>> Holder(3, "e", "box", 42, 0, 1_000, 15_000).describe(2_500)
            'host box, pid 42, since 1970-01-01 00:00:00 UTC (epoch 3, renewed 1.5 s ago)'
        """
        since = datetime.fromtimestamp(self.since_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
        age = max(0, now_ms - self.renewed_ms) / 1000
        state = "released" if self.released else f"renewed {age:.1f} s ago"
        return f"host {self.host}, pid {self.pid}, since {since} UTC (epoch {self.epoch}, {state})"


def unfenced() -> None:
    """The fence of a stage run outside an engine (tests, tools): none.

    Example:
        >>> unfenced()
    """


def holder_line(holder: Holder | None, now_ms: int) -> str:
    """What ``delayq status`` says about the engine holding the lakehouse.

    Example:
        >>> holder_line(Holder(3, "e", "box", 42, 0, 1_000, 15_000), 2_000)
        'host box, pid 42, since 1970-01-01 00:00:00 UTC (epoch 3)'
        >>> holder_line(None, 0)
        'none (no engine has run here)'
    """
    if holder is None:
        return "none (no engine has run here)"
    since = datetime.fromtimestamp(holder.since_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
    who = f"host {holder.host}, pid {holder.pid}, since {since} UTC (epoch {holder.epoch})"
    if holder.lapsed(now_ms):
        state = "stopped" if holder.released else "its lease ran out"
        return f"none running (the last: {who}, {state})"
    return who


class Lease:
    """The lease of one lakehouse, as seen by one engine.

    Args:
        lakehouse: the lakehouse root.
        clock: the engine clock.
        timeout_ms: how long the lease lasts without a renewal (``lease.timeout``).
    """

    def __init__(self, lakehouse: str, clock: Clock, timeout_ms: int) -> None:
        self.folder = f"{lakehouse.rstrip('/')}/{LEASE_DIR}"
        self.clock = clock
        self.timeout_ms = timeout_ms
        self.mine: Holder | None = None
        #: The claim this engine took over from (``None``: a new lakehouse).
        self.before: Holder | None = None
        self._lock = threading.Lock()

    def _now_ms(self) -> int:
        return int(self.clock.now().timestamp() * 1000)

    def _claim_path(self, epoch: int) -> str:
        return f"{self.folder}/{epoch:020d}.json"

    def _beat_path(self, epoch: int) -> str:
        return f"{self.folder}/{epoch:020d}.beat.json"

    def epochs(self) -> list[int]:
        """The epochs claimed so far, oldest first."""
        names = list_files(self.folder)
        return sorted(int(m.group(1)) for name in names if (m := _CLAIM.match(name)))

    def holder(self) -> Holder | None:
        """The newest claim with its latest renewal; ``None`` when no engine ever ran here."""
        epochs = self.epochs()
        if not epochs:
            return None
        claim = read_text(self._claim_path(epochs[-1]))
        if claim is None:
            return None
        holder = Holder(**json.loads(claim))
        beat = read_text(self._beat_path(holder.epoch))
        if beat:
            last = json.loads(beat)
            holder = replace(holder, renewed_ms=last["renewed_ms"], released=last["released"])
        return holder

    @property
    def held(self) -> bool:
        """Whether this engine holds the lease (acquired and not released)."""
        return self.mine is not None and not self.mine.released

    def acquire(self, standby: bool = False, stop: threading.Event | None = None) -> Holder:
        """Take the lakehouse: claim the next epoch unless another engine's lease runs.

        Args:
            standby: wait until the holder stops or its lease lapses, instead of refusing.
            stop: with ``standby``, give up waiting once this is set.

        Returns:
            This engine's claim.

        Raises:
            LakehouseHeldError: another engine holds the lakehouse (and not ``standby``,
                or ``stop`` was set while waiting).
        """
        told = False
        while True:
            current = self.holder()
            now = self._now_ms()
            if current is None or current.lapsed(now) or self._same_process(current):
                epoch = (current.epoch if current else 0) + 1
                mine = Holder(
                    epoch, uuid.uuid4().hex, socket.gethostname(), os.getpid(), now, now,
                    self.timeout_ms, machine=machine_key(), pid_start=started(os.getpid()),
                )  # fmt: skip
                claimed = put_if_absent(self._claim_path(epoch), _json(mine))
                if claimed and self.epochs()[-1] == epoch:
                    self.mine, self.before = mine, current
                    self._tidy(epoch)
                    if current is not None and not current.released:
                        log.warning("took the lakehouse over from %s", current.describe(now))
                    return mine
                continue  # another engine claimed it first: look again
            message = (
                f"another engine holds the lakehouse {self.folder.rsplit('/', 2)[0]}: "
                f"{current.describe(now)}. Stop it first, or start this one with "
                f"--set lease.standby=true to take over when it stops (its lease lasts "
                f"{current.timeout_ms / 1000:g} s without a renewal)"
            )
            if not standby or (stop is not None and stop.is_set()):
                raise LakehouseHeldError(message)
            if not told:
                log.warning("standing by: %s", message.split(". Stop it first")[0])
                told = True
            if stop is not None:
                stop.wait(STANDBY_POLL_S)
            else:
                time.sleep(STANDBY_POLL_S)

    def _same_process(self, holder: Holder) -> bool:
        """A claim made by this very process (another engine object, or this one before a
        restart in the same interpreter): the newer object takes over."""
        return (
            holder.machine == machine_key()
            and holder.pid == os.getpid()
            and holder.pid_start == started(os.getpid())
        )

    def check(self) -> None:
        """Raise unless this engine's epoch is still the newest.

        Raises:
            FencedError: another engine has claimed the lakehouse since (or this engine
                never held it).
        """
        mine = self.mine
        if mine is None:
            raise FencedError(f"this engine holds no lease on {self.folder}")
        newest = self.epochs()
        if not newest or newest[-1] != mine.epoch:
            other = self.holder()
            who = other.describe(self._now_ms()) if other else "unknown"
            raise FencedError(
                f"another engine took the lakehouse over ({who}); this one (epoch "
                f"{mine.epoch}) stops without planning or committing another round"
            )

    def renew(self) -> None:
        """Record that this engine is alive; raises :class:`FencedError` once fenced."""
        with self._lock:
            self.check()
            assert self.mine is not None
            self.mine = replace(self.mine, renewed_ms=self._now_ms())
            self._write_beat(self.mine)

    def release(self) -> None:
        """Let the lakehouse go (a clean stop): the next engine takes it at once."""
        with self._lock:
            mine = self.mine
            if mine is None or mine.released:
                return
            self.mine = replace(mine, released=True, renewed_ms=self._now_ms())
            newest = self.epochs()
            if newest and newest[-1] == mine.epoch:  # never mark a successor's epoch
                self._write_beat(self.mine)

    def _write_beat(self, holder: Holder) -> None:
        beat = {"renewed_ms": holder.renewed_ms, "released": holder.released}
        write_text(self._beat_path(holder.epoch), json.dumps(beat))

    def _tidy(self, newest: int) -> None:
        """Delete claims (and their renewals) more than ``KEEP_EPOCHS`` older than ``newest``."""
        for epoch in self.epochs():
            if epoch <= newest - KEEP_EPOCHS:
                for location in (self._beat_path(epoch), self._claim_path(epoch)):
                    delete_file(location)


def _json(holder: Holder) -> bytes:
    return json.dumps(asdict(holder)).encode("utf-8")


class Heartbeat:
    """Renews a lease every third of its timeout in a daemon thread, until stopped.

    A renewal that finds the engine fenced calls ``on_fenced`` with the error and ends.

    Example:
        >>> beat = Heartbeat(lease, on_fenced=print).start()  # doctest: +SKIP
        >>> beat.stop()                                       # doctest: +SKIP
    """

    def __init__(self, lease: Lease, on_fenced: Callable[[FencedError], None]) -> None:
        self.lease = lease
        self.on_fenced = on_fenced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Start renewing; returns ``self``."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="delayq-lease", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        interval = self.lease.timeout_ms / 3000
        while True:
            try:
                self.lease.renew()
            except FencedError as err:
                self.on_fenced(err)
                return
            except Exception:  # a storage hiccup: the next renewal may pass in time
                log.warning("lease renewal failed; trying again", exc_info=True)
            if self._stop.wait(interval):
                return

    def stop(self) -> None:
        """Stop renewing (the lease lapses after its timeout unless released)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
