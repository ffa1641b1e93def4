"""Reads that respect the log's order: the freshest of several replicas, and read-your-writes.

A write's :class:`~replica_lib.producer.Position` (returned by the producer library) is a token: a replica table has
applied it once the table's newest replica commit records an end offset past it (:mod:`replica_lib.progress`), or
once the replica's checkpoint says a later batch finished (every table of a batch is written before the batch
ends, so a table that took no change of that batch also reflects the write). The read is then pinned to the table
version that was checked, so every query over it sees the same state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession

from replica_lib.config import ReplicaConfig, TableConfig
from replica_lib.errors import ConfigError, NotAppliedError
from replica_lib.layout import read_state
from replica_lib.producer import Position
from replica_lib.progress import Offsets, applied_offsets, applied_versions, last_committed_offsets
from replica_lib.target import applied_target, delta_table, read_table, table_exists

logger = logging.getLogger(__name__)

#: How often :func:`wait_for` looks at the table's log again while a write is not applied yet.
POLL_S = 0.5


@dataclass(frozen=True)
class Snapshot:
    """One replica table as of one Delta version, and the log offsets that version reflects."""

    replica: ReplicaConfig
    table: TableConfig
    version: int | None  # None: the table has no replica commit yet
    offsets: Offsets  # topic -> partition -> next offset to apply

    def read(self, spark: SparkSession) -> DataFrame:
        """The table's rows at exactly this version (a merge-on-read table's state, its change log there)."""
        if self.table.merge_on_read:
            return read_state(spark, self.table, self.version)
        return read_table(spark, self.table.target, self.version)

    def applied(self, position: Position) -> bool:
        return self.offsets.get(position.topic, {}).get(position.partition, 0) > position.offset

    def total(self) -> int:
        return sum(sum(parts.values()) for parts in self.offsets.values())


def snapshot(spark: SparkSession, cfg: ReplicaConfig, table: str) -> Snapshot:
    """The table's newest version and what it has applied: its own commits, or a later finished batch."""
    config = cfg.table_named(table, "tables")
    # The checkpoint first, the table's version next: a batch the checkpoint says finished had written the table
    # before it finished, so that version holds it.
    finished = last_committed_offsets(spark, cfg.checkpoint)
    if not table_exists(spark, config.target):
        return Snapshot(cfg, config, None, {})
    version = _latest_version(spark, config)
    applied = applied_offsets(spark, applied_target(config), version)
    offsets: Offsets = {t: dict(parts) for t, parts in (applied.offsets if applied else {}).items()}
    for partition, offset in (finished or {}).get(config.topic, {}).items():
        parts = offsets.setdefault(config.topic, {})
        parts[partition] = max(parts.get(partition, 0), offset)
    return Snapshot(cfg, config, version, offsets)


def snapshot_at(spark: SparkSession, cfg: ReplicaConfig, table: str, positions: Iterable[Position]) -> Snapshot:
    """The table as of the first Delta version that reflected every position (time travel to a point of the log).

    Raises :class:`NotAppliedError` if no version has applied them yet. ``Snapshot.read`` gives its rows.
    """
    config = cfg.table_named(table, "tables")
    wanted = list(positions)
    for applied in applied_versions(spark, applied_target(config)):
        found = Snapshot(cfg, config, applied.version, {t: dict(parts) for t, parts in applied.offsets.items()})
        if all(found.applied(p) for p in wanted):
            return found
    raise NotAppliedError(
        f"no version of {cfg.name}.{table} has applied "
        + ", ".join(f"{p.topic}:{p.partition}:{p.offset}" for p in wanted)
        + " yet; check how far the replica is (its status)"
    )


def freshest(spark: SparkSession, replicas: Sequence[ReplicaConfig], table: str) -> Snapshot:
    """Of several replicas of one log, the snapshot of the one that has applied the most of it (monotonic reads:
    replicas only move forward, so reading the freshest never shows a state older than one read before)."""
    if not replicas:
        raise ValueError("no replica given")
    snapshots = [snapshot(spark, cfg, table) for cfg in replicas]
    topics = {s.table.topic for s in snapshots}
    if len(topics) > 1:
        raise ConfigError(
            replicas[-1].source_file,
            f"tables.{table}.topic",
            "the replicas given read different topics, so they are not replicas of one log",
            "give only replicas of the same topic",
        )
    best = max(snapshots, key=Snapshot.total)  # the first of equals: the order given is the preference
    if len(snapshots) > 1:
        logger.info(
            "freshest replica for %s: %s (records applied: %s)",
            table,
            best.replica.name,
            ", ".join(f"{s.replica.name} {s.total()}" for s in snapshots),
        )
    return best


def wait_for(
    spark: SparkSession,
    replicas: Sequence[ReplicaConfig],
    table: str,
    positions: Iterable[Position],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> Snapshot:
    """Wait until one of ``replicas`` has applied every position to ``table``; its snapshot, pinned at that point.

    Raises :class:`NotAppliedError` after ``timeout_s`` with how far each replica is from the positions.
    """
    wanted = list(positions)
    deadline = clock() + timeout_s
    while True:
        snapshots = [snapshot(spark, cfg, table) for cfg in replicas]
        ready = [s for s in snapshots if all(s.applied(p) for p in wanted)]
        if ready:
            return max(ready, key=Snapshot.total)
        if clock() >= deadline:
            raise NotAppliedError(_not_applied(snapshots, wanted, timeout_s))
        time.sleep(POLL_S)


def parse_position(text: str) -> Position:
    """``topic:partition:offset`` (as the producer prints a write's position) as a :class:`Position`."""
    topic, _, rest = text.rpartition(":")
    topic, _, partition = topic.rpartition(":")
    try:
        position = Position(topic, int(partition), int(rest))
    except ValueError:
        position = None
    if position is None or not topic or position.partition < 0 or position.offset < 0:
        raise ValueError(f"{text!r} is not a position: expected topic:partition:offset, e.g. orders:0:7275")
    return position


def _latest_version(spark: SparkSession, table: TableConfig) -> int:
    row = delta_table(spark, applied_target(table)).history(1).select("version").first()
    assert row is not None
    return int(row[0])


def _not_applied(snapshots: Sequence[Snapshot], positions: Sequence[Position], timeout_s: float) -> str:
    def behind(s: Snapshot) -> str:
        missing = [
            f"{p.topic}:{p.partition} at {s.offsets.get(p.topic, {}).get(p.partition, 0)}, needs {p.offset + 1}"
            for p in positions
            if not s.applied(p)
        ]
        return f"{s.replica.name} ({'; '.join(missing)})"

    return (
        f"no replica applied the write within {timeout_s:g}s: " + ", ".join(behind(s) for s in snapshots) + "; "
        "check that the replica is running and how far behind it is (its status)"
    )
