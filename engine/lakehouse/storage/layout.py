"""Where each table lives in a lakehouse.

Layout under the lakehouse root::

    commitlog/          every message sent
    schedule/           stamped messages, partitioned by queue_id
    quarantine/         messages refused by the engine, with the reason
    delay_offset/       the delivery checkpoint (per-queue progress)
    commands/           cancel and reschedule commands from users
    command_results/    what each command did
    consumer_log/       consumer groups' commits (progress, failed messages)
    recurring/          recurring schedules (their revisions)
    schedule_requests/  changes to recurring schedules asked for in SQL
    topics/<topic>/     one table per real topic
    _checkpoints/       Spark streaming checkpoints

Example:
    >>> Layout("/lake").topic("Orders")
    '/lake/topics/orders'
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.config import EngineConfig
from engine.core.topics import topic_table_name
from engine.lakehouse.storage.location import register
from engine.lakehouse.storage.store import S3Settings


@dataclass(frozen=True)
class Layout:
    """Paths of every table in one lakehouse."""

    root: str

    @property
    def commitlog(self) -> str:
        """Path of the ``commitlog`` table."""
        return f"{self.root}/commitlog"

    @property
    def schedule(self) -> str:
        """Path of the ``schedule`` table."""
        return f"{self.root}/schedule"

    @property
    def quarantine(self) -> str:
        """Path of the ``quarantine`` table."""
        return f"{self.root}/quarantine"

    @property
    def delay_offset(self) -> str:
        """Path of the delivery checkpoint (a log of JSON files)."""
        return f"{self.root}/delay_offset"

    @property
    def commands(self) -> str:
        """Path of the ``commands`` table (cancel / reschedule)."""
        return f"{self.root}/commands"

    @property
    def command_results(self) -> str:
        """Path of the ``command_results`` table."""
        return f"{self.root}/command_results"

    @property
    def consumer_log(self) -> str:
        """Path of the ``consumer_log`` table (consumer groups' commits)."""
        return f"{self.root}/consumer_log"

    @property
    def recurring(self) -> str:
        """Path of the ``recurring`` table (recurring schedules' revisions)."""
        return f"{self.root}/recurring"

    @property
    def schedule_requests(self) -> str:
        """Path of the ``schedule_requests`` table (changes to recurring schedules asked for
        in SQL)."""
        return f"{self.root}/schedule_requests"

    @property
    def recurring_next(self) -> str:
        """Folder where the engine publishes each recurring schedule's next occurrence
        (one file, replaced whole), for the ``schedules`` view."""
        return self.checkpoint("recurring-next")

    @property
    def topics(self) -> str:
        """Folder holding one table per topic."""
        return f"{self.root}/topics"

    def topic(self, topic: str) -> str:
        """Path of one topic's table."""
        return f"{self.topics}/{topic_table_name(topic)}"

    def engine_file(self, name: str) -> str:
        """Path of a file the running engine keeps in ``_engine/`` (its lease, addresses)."""
        return f"{self.root}/_engine/{name}"

    def checkpoint(self, query: str) -> str:
        """Spark checkpoint folder of a streaming query."""
        return f"{self.root}/_checkpoints/{query}"

    def table(self, name: str) -> str:
        """Path of one of the engine's tables by name (``commitlog``, ``schedule``, ...)."""
        return str(getattr(self, name))


def layout(cfg: EngineConfig) -> Layout:
    """The layout of the lakehouse ``cfg`` points at; an S3 lakehouse's settings are
    registered for its files (:func:`engine.lakehouse.storage.location.register`).

    Example:
        >>> layout(EngineConfig(lakehouse="/lake")).schedule
        '/lake/schedule'
    """
    if cfg.on_object_store:
        settings = S3Settings(
            endpoint=cfg.s3_endpoint,
            region=cfg.s3_region,
            access_key=cfg.s3_access_key,
            secret_key=cfg.s3_secret_key,
            path_style=cfg.s3_path_style,
        )
        register(cfg.lakehouse_path, settings)
    return Layout(cfg.lakehouse_path)
