"""Keeping a replica tidy: dropping retained deletes once that can no longer let a deleted key come back.

The tombstone table is a log the replica only appends to (one row per winning delete), so it also holds deletes
that no longer count: one superseded by a newer delete of its key, or by the key's live row (upserted again).
:func:`compact_tombstones` drops those; what any change is checked against, the greatest version among a key's
row and retained deletes, stays the same.

The rule for a retained delete (a row of ``<table>__tombstones``) of key *k* at ``(partition p, offset o)``:
it is purged only when

1. it is older than the replica's ``tombstone_retention`` (default 7 days), which bounds how late a reordered,
   older change of *k* may still arrive from the primary; and
2. the log no longer holds any record of partition *p* at or before offset *o* (the partition's log start offset
   is past *o*), so no replay can ever deliver an older change of *k* again; and
3. nor does the quarantine, unresolved: a record of partition *p* before *o*, replayed after a fix, may be an older
   change of *k*, which only the retained delete tells apart from a new one.

On a compacted topic the log start offset does not move, so condition 2 keeps its deletes for good: the
tombstone table is then bounded by the number of deleted keys, never by the number of changes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_lib.config import ReplicaConfig, TableConfig, Target
from replica_lib.errors import (
    ConcurrentAppendError,
    ConcurrentDeleteDeleteError,
    ConcurrentDeleteReadError,
    MaintenanceError,
)
from replica_lib.merge import (
    compact_files,
    delete_matching,
    delete_where,
    typed_conflicts,
    vacuum_files,
    zorder_files,
)
from replica_lib.ordering import current_versions, newer
from replica_lib.quarantine import unresolved
from replica_lib.recovery import replica_running
from replica_lib.target import (
    delta_table,
    file_count,
    is_empty,
    read_table,
    replica_targets,
    table_exists,
    tombstone_target,
    version_columns,
)
from replica_lib.topics import TopicAdmin

logger = logging.getLogger(__name__)


def purge_condition(log_start: dict[str, dict[int, int]], cutoff: datetime) -> str | None:
    """The SQL predicate selecting purgeable tombstones, or None if nothing can be purged."""
    terms = [
        f"(_src_topic = '{topic}' AND _src_partition = {partition} AND _src_offset < {start})"
        for topic, partitions in sorted(log_start.items())
        for partition, start in sorted(partitions.items())
        if start > 0
    ]
    if not terms:
        return None
    stamp = cutoff.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"_deleted_at < TIMESTAMP '{stamp}' AND ({' OR '.join(terms)})"


def purge_tombstones(
    spark: SparkSession, cfg: ReplicaConfig, admin: TopicAdmin | None, now: datetime | None = None
) -> dict[str, int]:
    """Purge every table's retained deletes that the rule above allows; returns how many per table.

    Without ``admin`` (no confluent-kafka client can reach the cluster) the log's start offsets are unknown, so
    nothing is purged.
    """
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=cfg.tombstone_retention_s)
    purged: dict[str, int] = {}
    if admin is None:
        return {table.name: 0 for table in cfg.tables}
    quarantined = _quarantine_starts(spark, cfg)
    for table in cfg.tables:
        held = quarantined.get(table.topic, {})
        starts = {p: min(o, held.get(p, o)) for p, o in admin.earliest_offsets(table.topic).items()}
        condition = purge_condition({table.topic: starts}, cutoff)
        target, purged[table.name] = tombstone_target(table), 0
        if condition:
            purged[table.name] = _retrying(
                f"purging {target.describe()}", partial(delete_where, spark, target, condition)
            )
        logger.info("replica %s table %s: purged %d retained deletes", cfg.name, table.name, purged[table.name])
    return purged


def _quarantine_starts(spark: SparkSession, cfg: ReplicaConfig) -> dict[str, dict[int, int]]:
    """Per topic and partition, the lowest offset of an unresolved quarantined record (of any table: a record whose
    table could not be read may be any of its topic's)."""
    if is_empty(spark, cfg.quarantine):
        return {}
    records = unresolved(spark, cfg)
    if records is None:
        return {}
    starts: dict[str, dict[int, int]] = {}
    for row in records.groupBy("topic", "partition").agg(F.min("offset").alias("offset")).collect():
        starts.setdefault(str(row["topic"]), {})[int(row["partition"])] = int(row["offset"])
    return starts


#: How many times maintenance tries a delete that the running replica's writes keep conflicting with.
ATTEMPTS = 10
#: Delta's refusals of a delete that a concurrent commit invalidated: the replica appended retained deletes, or an
#: OPTIMIZE rewrote (or another delete removed) files that the delete had read.
_RETRIED = (ConcurrentAppendError, ConcurrentDeleteReadError, ConcurrentDeleteDeleteError)


def _retrying(what: str, action: Callable[[], int]) -> int:
    """Run a delete from a tombstone table, again when the replica wrote to it meanwhile (Delta refuses it)."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            with typed_conflicts():
                return action()
        except _RETRIED as conflict:
            logger.info(
                "%s: the replica wrote to the table meanwhile (%s, attempt %d of %d)",
                what,
                type(conflict).__name__,
                attempt,
                ATTEMPTS,
            )
    raise MaintenanceError(
        f"{what}: the running replica appended retained deletes (or an OPTIMIZE ran) during each of {ATTEMPTS} "
        "attempts; run maintenance again, ideally when the replica has fewer deletes to apply"
    )


def compact_tombstones(spark: SparkSession, table: TableConfig) -> int:
    """Drop a table's retained deletes that a newer delete or the live row of their key supersedes.

    It may run beside the replica: a row the replica removes meanwhile is removed by a newer delete, which is
    retained; when the replica appends deletes during the MERGE, Delta refuses it and it runs again.
    """
    keys = list(table.keys)
    version_cols = version_columns(table.keys)
    tombstones = read_table(spark, tombstone_target(table))
    rows = read_table(spark, table.target)
    latest = current_versions(keys, tombstones.select(*version_cols), rows.select(*version_cols))
    superseded = tombstones.join(latest, keys).where(
        newer(
            F.col("_cur_seq"),
            F.col("_cur_partition"),
            F.col("_cur_offset"),
            F.col("_src_seq"),
            F.col("_src_partition"),
            F.col("_src_offset"),
        )
    )
    identity = (*keys, "_src_topic", "_src_partition", "_src_offset")
    target = tombstone_target(table)
    return _retrying(
        f"compacting {target.describe()}",
        lambda: delete_matching(spark, target, superseded.select(*identity).distinct(), identity),
    )


@dataclass(frozen=True)
class Tidied:
    """What maintenance dropped from one table's retained deletes."""

    superseded: int
    purged: int


def maintain(
    spark: SparkSession, cfg: ReplicaConfig, admin: TopicAdmin | None, now: datetime | None = None
) -> dict[str, Tidied]:
    """Compact every table's tombstone log, then purge what the retention rule allows (nothing without ``admin``)."""
    superseded = {}
    for table in cfg.tables:
        superseded[table.name] = compact_tombstones(spark, table)
        logger.info(
            "replica %s table %s: dropped %d superseded retained deletes", cfg.name, table.name, superseded[table.name]
        )
    purged = purge_tombstones(spark, cfg, admin, now)
    return {name: Tidied(superseded[name], purged[name]) for name in superseded}


# ------------------------------------------------------------------------------------------------ files
#: Delta's default time-travel window (``delta.deletedFileRetentionDuration``): a week.
DEFAULT_TIME_TRAVEL_HOURS = 168.0
#: While the replica (or a swap into it) runs, VACUUM keeps at least this much: a batch reads the version it
#: started from, and a MERGE retried after a conflict reads a newer one, each for seconds to minutes.
RUNNING_FLOOR_HOURS = 1.0

_UNIT_HOURS = {"week": 168.0, "day": 24.0, "hour": 1.0, "minute": 1 / 60, "second": 1 / 3600, "millisecond": 1 / 3.6e6}
_INTERVAL_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(week|day|hour|minute|second|millisecond)s?", re.IGNORECASE)


def interval_hours(interval: str) -> float:
    """Hours of a Delta interval property such as ``interval 1 week`` or ``interval 2 days 12 hours``."""
    parts = _INTERVAL_PART.findall(interval)
    if not parts or not interval.strip().lower().startswith("interval"):
        raise ValueError(f"{interval!r} is not a Delta interval (e.g. 'interval 7 days')")
    return sum(float(n) * _UNIT_HOURS[unit.lower()] for n, unit in parts)


def vacuum_retention(target: str, requested: float | None, window_h: float, running: bool | None) -> float:
    """The hours VACUUM may keep on ``target``: ``requested`` (default: the table's time-travel window).

    Refused with the reason (:class:`MaintenanceError`) when shorter than the window, which readers time-travel
    within, or, while the replica may be running (``running`` True or unknown), than :data:`RUNNING_FLOOR_HOURS`.
    """
    floor = max(window_h, RUNNING_FLOOR_HOURS if running is not False else 0.0)
    retention = floor if requested is None else requested
    if not retention >= window_h:  # NaN too, which no comparison would refuse, and VACUUM would take as 0 h
        raise MaintenanceError(
            f"{target}: a retention of {retention:g} h is shorter than the table's time-travel window "
            f"(delta.deletedFileRetentionDuration, {window_h:g} h): VACUUM would delete files that readers of the "
            f"versions inside it need; give --retain-hours {window_h:g} or more, or shorten the window first with "
            f"ALTER TABLE {target} SET TBLPROPERTIES ('delta.deletedFileRetentionDuration' = 'interval N hours')"
        )
    if retention < floor:
        state = "is running" if running else "may be running (its checkpoint is not on a local disk)"
        raise MaintenanceError(
            f"{target}: a retention of {retention:g} h is refused while the replica {state}: its batches read the "
            f"version they started from; give --retain-hours {floor:g} or more, or stop the replica first"
        )
    return retention


def time_travel_hours(spark: SparkSession, target: Target) -> float:
    """A table's time-travel window: its ``delta.deletedFileRetentionDuration`` (a week by default)."""
    properties = delta_table(spark, target).detail().select("properties").first()
    value = None if properties is None else (properties[0] or {}).get("delta.deletedFileRetentionDuration")
    return DEFAULT_TIME_TRAVEL_HOURS if value is None else interval_hours(str(value))


@dataclass(frozen=True)
class Files:
    """What maintenance did to one table's files: packed by OPTIMIZE, deleted by VACUUM (None: not run)."""

    target: str
    files_before: int
    files_after: int
    vacuumed: int | None = None
    retain_hours: float | None = None
    zorder: tuple[str, ...] = ()  # the columns its files were z-ordered by; empty: packed

    def line(self) -> str:
        vacuum = "" if self.retain_hours is None else f"; vacuum (keeping {self.retain_hours:g} h): "
        if self.retain_hours is not None:
            vacuum += "deleted files not counted" if self.vacuumed is None else f"{self.vacuumed} files deleted"
        how = f"z-ordered by {', '.join(self.zorder)}" if self.zorder else "optimize"
        return f"{self.target}: {self.files_before} files, {self.files_after} after {how}{vacuum}"


def vacuum_plan(spark: SparkSession, cfg: ReplicaConfig, retain_hours: float | None = None) -> dict[str, float]:
    """The retention VACUUM keeps on each existing table of the replica, every one checked by
    :func:`vacuum_retention` (raises :class:`MaintenanceError` before anything is done)."""
    running = replica_running(cfg)
    return {
        t.describe(): vacuum_retention(t.describe(), retain_hours, time_travel_hours(spark, t), running)
        for t in replica_targets(cfg)
        if table_exists(spark, t)
    }


def tidy_files(
    spark: SparkSession,
    cfg: ReplicaConfig,
    optimize: bool = True,
    vacuum: Mapping[str, float] | None = None,
    zorder: bool = False,
) -> list[Files]:
    """OPTIMIZE (pack small files) and VACUUM (delete unreferenced files, keeping ``vacuum[table]`` hours, from
    :func:`vacuum_plan`; None: no VACUUM) every table of the replica.

    ``zorder``: rewrite each replica table's files ordered by its keys instead of packing them (every file, each
    time), so that a lookup or a batch's MERGE by key reads few files; the other tables are packed.

    Safe beside the running replica: its MERGE runs again when an OPTIMIZE commit wins (``replica_lib.batch``),
    and VACUUM keeps what :func:`vacuum_retention` allows.
    """
    done = []
    keys = {table.target.describe(): table.keys for table in cfg.tables} if zorder else {}
    for target in [t for t in replica_targets(cfg) if table_exists(spark, t)]:
        before = file_count(spark, target) or 0  # the table exists: None only for a missing one
        by = keys.get(target.describe(), ())
        if by:
            zorder_files(spark, target, by)
        elif optimize:
            compact_files(spark, target, cfg.compaction.small_file_mb << 20)
        after = file_count(spark, target) or 0
        hours = None if vacuum is None else vacuum.get(target.describe())
        deleted = None if hours is None else vacuum_files(spark, target, hours)
        done.append(Files(target.describe(), before, after, deleted, hours, by))
        logger.info("replica %s: %s", cfg.name, done[-1].line())
    return done
