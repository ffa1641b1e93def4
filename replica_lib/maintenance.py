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
   is past *o*), so no replay can ever deliver an older change of *k* again.

On a compacted topic the log start offset does not move, so condition 2 keeps its deletes for good: the
tombstone table is then bounded by the number of deleted keys, never by the number of changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_lib.config import ReplicaConfig, TableConfig
from replica_lib.errors import (
    ConcurrentAppendError,
    ConcurrentDeleteDeleteError,
    ConcurrentDeleteReadError,
    MaintenanceError,
)
from replica_lib.merge import delete_matching, delete_where, typed_conflicts
from replica_lib.ordering import current_versions, newer
from replica_lib.target import read_table, tombstone_target, version_columns
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
    for table in cfg.tables:
        condition = purge_condition({table.topic: admin.earliest_offsets(table.topic)}, cutoff)
        target, purged[table.name] = tombstone_target(table), 0
        if condition:
            purged[table.name] = _retrying(
                f"purging {target.describe()}", partial(delete_where, spark, target, condition)
            )
        logger.info("replica %s table %s: purged %d retained deletes", cfg.name, table.name, purged[table.name])
    return purged


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
