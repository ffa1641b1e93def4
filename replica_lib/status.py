"""How far behind the log a replica is, read from its tables and the broker (never from its checkpoint).

Per table: the offsets its newest replica commit applied (stored in that Delta commit), the log's end offsets
(``read_committed``, as the replica reads), the lag in records per partition and in total, the age of the newest
change it holds (event time) and of its last commit, its version, rows and quarantined records, and a verdict
against :class:`Thresholds`. The tables say what they hold, so a status is right even while the replica is down.

A table's offsets are those of the last batch that wrote to it: on a topic that feeds several tables, a table no
recent batch changed shows the records since as lag, though none of them were its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from replica_lib.config import ReplicaConfig, TableConfig
from replica_lib.errors import TopicError
from replica_lib.layout import read_state
from replica_lib.metrics import late_counts, unknown_field_counts
from replica_lib.progress import newest_commit
from replica_lib.quarantine import unresolved
from replica_lib.target import applied_target, delta_table, read_table, table_exists, tombstone_target
from replica_lib.topics import TopicAdmin


@dataclass(frozen=True)
class Thresholds:
    """When a table counts as unhealthy: more records behind than ``max_lag_records``, or records waiting and no
    commit for longer than ``max_lag_seconds`` (a stalled replica). An idle log is healthy however old its last
    change, so the event-time age is shown but not judged."""

    max_lag_records: int = 10_000
    max_lag_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.max_lag_records < 0 or self.max_lag_seconds < 0:
            raise ValueError("lag thresholds must be >= 0")


@dataclass(frozen=True)
class PartitionLag:
    """One partition of a table's topic: what the table applied and where the log ends."""

    partition: int
    applied: int | None  # the next offset to apply (Kafka's committed-offset convention); None: nothing yet
    end: int | None  # the log's end for read_committed readers; None when the broker could not be asked
    lag: int | None  # records from ``applied`` (or the log's start) to ``end``


@dataclass(frozen=True)
class TableStatus:
    """One table of a replica: its progress through the log, its size, and the verdict."""

    table: str
    topic: str
    partitions: tuple[PartitionLag, ...]
    version: int | None = None  # the table's latest Delta version
    rows: int | None = None
    quarantined: int | None = None  # the replica's unresolved quarantined records that name this table
    batch_id: int | None = None  # of the table's newest replica commit
    last_commit_s: float | None = None  # when that commit was made (seconds since the epoch)
    newest_event_s: float | None = None  # the newest event time among the table's rows and retained deletes
    late: int | None = None  # late changes the replica counted for this table (None: it keeps no metrics table)
    #: Records that carried a field the table does not keep, by field (from the metrics table; empty without one).
    fields_not_kept: dict[str, int] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # what could not be read
    unhealthy: tuple[str, ...] = ()  # why the table is unhealthy; empty when healthy

    @property
    def lag_records(self) -> int | None:
        lags = [p.lag for p in self.partitions]
        return None if not lags or any(lag is None for lag in lags) else sum(lag for lag in lags if lag is not None)

    @property
    def healthy(self) -> bool:
        return not self.unhealthy


@dataclass(frozen=True)
class ReplicaStatus:
    """A replica's tables at one moment (``checked_s``, seconds since the epoch)."""

    replica: str
    source_file: str
    checked_s: float
    thresholds: Thresholds
    tables: tuple[TableStatus, ...]
    problems: tuple[str, ...] = field(default=())  # the replica's own (an unreachable broker)

    @property
    def healthy(self) -> bool:
        return not self.problems and all(t.healthy for t in self.tables)

    @property
    def lag_records(self) -> int | None:
        lags = [t.lag_records for t in self.tables]
        return None if any(lag is None for lag in lags) else sum(lag for lag in lags if lag is not None)

    def age_s(self, moment_s: float | None) -> float | None:
        """Seconds from ``moment_s`` to when the status was taken."""
        return None if moment_s is None else max(0.0, self.checked_s - moment_s)

    def to_dict(self) -> dict[str, Any]:
        """The status as JSON-ready data (times in ISO 8601 UTC, ages in seconds)."""
        return {
            "replica": self.replica,
            "file": self.source_file,
            "checked_at": _iso(self.checked_s),
            "healthy": self.healthy,
            "lag_records": self.lag_records,
            "thresholds": asdict(self.thresholds),
            "problems": list(self.problems),
            "tables": [
                {
                    "table": t.table,
                    "topic": t.topic,
                    "healthy": t.healthy,
                    "unhealthy": list(t.unhealthy),
                    "problems": list(t.problems),
                    "lag_records": t.lag_records,
                    "partitions": [asdict(p) for p in t.partitions],
                    "version": t.version,
                    "rows": t.rows,
                    "quarantined": t.quarantined,
                    "batch_id": t.batch_id,
                    "last_commit_at": _iso(t.last_commit_s),
                    "since_commit_s": _round(self.age_s(t.last_commit_s)),
                    "newest_event_at": _iso(t.newest_event_s),
                    "event_age_s": _round(self.age_s(t.newest_event_s)),
                    "late_changes": t.late,
                    "fields_not_kept": t.fields_not_kept,
                }
                for t in self.tables
            ],
        }


def _iso(epoch_s: float | None) -> str | None:
    return None if epoch_s is None else datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds")


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


# ------------------------------------------------------------------------------------------------ reading
def replica_status(
    spark: SparkSession,
    cfg: ReplicaConfig,
    admin: TopicAdmin | None,
    thresholds: Thresholds | None = None,
    no_admin_reason: str = "no Kafka client to read the log's end offsets with",
) -> ReplicaStatus:
    """Read a replica's status from its tables, and the log's end offsets from ``admin``.

    ``admin`` None (the broker is unreachable, or the connection has no librdkafka equivalent) leaves the lag in
    records unknown and the replica unhealthy, saying ``no_admin_reason``.
    """
    thresholds = thresholds or Thresholds()
    problems = () if admin is not None else (no_admin_reason,)
    logs: dict[str, tuple[dict[int, int], dict[int, int]] | str] = {}
    if admin is not None:
        for topic in cfg.topics:
            try:
                logs[topic] = (admin.earliest_offsets(topic), admin.latest_offsets(topic))
            except TopicError as exc:
                logs[topic] = str(exc)
    checked_s = time.time()
    late, unknown = _metrics_counts(spark, cfg)
    tables = tuple(
        judge(
            replace(
                _table_status(spark, cfg, t, logs.get(t.topic)),
                late=late.get(t.name),
                fields_not_kept=unknown.get(t.name, {}),
            ),
            thresholds,
            checked_s,
        )
        for t in cfg.tables
    )
    return ReplicaStatus(cfg.name, cfg.source_file, checked_s, thresholds, tables, problems)


def _metrics_counts(spark: SparkSession, cfg: ReplicaConfig) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Late changes, and records with fields not kept, by table from the replica's metrics table; empty when it
    keeps none or it cannot be read."""
    try:
        return late_counts(spark, cfg) or {}, unknown_field_counts(spark, cfg) or {}
    except (AnalysisException, Py4JJavaError):
        return {}, {}


def _table_status(
    spark: SparkSession, cfg: ReplicaConfig, table: TableConfig, log: tuple[dict[int, int], dict[int, int]] | str | None
) -> TableStatus:
    problems = [log] if isinstance(log, str) else []
    try:
        exists = table_exists(spark, table.target)
        if not exists:
            problems.append(f"no Delta table at {table.target.describe()} yet: run the replica")
            read = {}
        else:
            read = _read_table(spark, cfg, table)
    except (AnalysisException, Py4JJavaError) as exc:
        problems.append(f"cannot read {table.target.describe()}: {_first_line(exc)}")
        read = {}
    applied = read.pop("applied", {})
    start, end = log if isinstance(log, tuple) else ({}, {})
    partitions = sorted(set(applied) | set(end))
    lags = []
    for p in partitions:
        ends_at = end.get(p)
        from_ = applied.get(p, start.get(p))
        if ends_at is not None and from_ is not None and from_ > ends_at:
            problems.append(
                f"partition {p}: applied up to {from_}, beyond the log's end {ends_at} (was the topic recreated?)"
            )
        lag = None if ends_at is None or from_ is None else max(0, ends_at - from_)
        lags.append(PartitionLag(p, applied.get(p), ends_at, lag))
    return TableStatus(table.name, table.topic, tuple(lags), problems=tuple(problems), **read)


def _read_table(spark: SparkSession, cfg: ReplicaConfig, table: TableConfig) -> dict[str, Any]:
    """What one table says of itself: version, rows, newest event, newest replica commit, quarantined records."""
    event_s = F.unix_micros(F.max("_src_event_ts")) / 1e6
    rows_row = read_state(spark, table).agg(F.count(F.lit(1)).alias("rows"), event_s.alias("event_s")).first()
    assert rows_row is not None
    events = [rows_row["event_s"]]
    deletes = tombstone_target(table)
    if table_exists(spark, deletes):  # a delete is a change too: its event time is kept with it
        events.append(read_table(spark, deletes).agg(event_s).first()[0])  # type: ignore[index]
    version_row = delta_table(spark, table.target).history(1).select("version").first()
    commit = newest_commit(spark, applied_target(table), cfg.name)
    records = unresolved(spark, cfg)  # replayed and dropped records no longer count
    quarantined = None
    if records is not None:
        mine = (F.col("replica") == cfg.name) & (F.col("table") == table.name)
        quarantined = records.where(mine).count()
    known = [e for e in events if e is not None]
    return {
        "version": None if version_row is None else int(version_row["version"]),
        "rows": int(rows_row["rows"]),
        "quarantined": quarantined,
        "batch_id": None if commit is None else commit.applied.batch_id,
        "last_commit_s": None if commit is None else commit.committed_s,
        "newest_event_s": max(known) if known else None,
        "applied": {} if commit is None else dict(commit.applied.offsets.get(table.topic, {})),
    }


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def judge(status: TableStatus, thresholds: Thresholds, now_s: float) -> TableStatus:
    """The table with its verdict: unhealthy if anything could not be read, or past a threshold."""
    reasons = list(status.problems)
    lag = status.lag_records
    if lag is not None and lag > thresholds.max_lag_records:
        reasons.append(f"{lag} records behind, over {thresholds.max_lag_records}")
    if lag:
        idle = None if status.last_commit_s is None else now_s - status.last_commit_s
        if idle is not None and idle > thresholds.max_lag_seconds:
            reasons.append(
                f"{lag} records waiting and no commit for {_duration(idle)}, over {thresholds.max_lag_seconds:g}s"
            )
    return TableStatus(**{**_fields(status), "unhealthy": tuple(reasons)})


def _fields(status: TableStatus) -> dict[str, Any]:
    return {name: getattr(status, name) for name in TableStatus.__dataclass_fields__}


# ------------------------------------------------------------------------------------------------ showing
def _duration(seconds: float | None) -> str:
    """A short age: ``42s``, ``3m05s``, ``2h01m``, ``4d03h``; ``-`` if unknown."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


COLUMNS = (
    "REPLICA",
    "TABLE",
    "TOPIC",
    "LAG",
    "EVENT AGE",
    "LAST COMMIT",
    "BATCH",
    "VERSION",
    "ROWS",
    "QUAR.",
    "LATE",
    "STATUS",
)


def render(statuses: Sequence[ReplicaStatus], partitions: bool = False) -> str:
    """The statuses as a table for a terminal, then one line per reason a table is unhealthy.

    With ``partitions``, each table is followed by a line per partition: applied, end, lag.
    """
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    for status in statuses:
        notes.extend(f"{status.replica}: {problem}" for problem in status.problems)
        for t in status.tables:
            rows.append(
                (
                    status.replica,
                    t.table,
                    t.topic,
                    _cell(t.lag_records),
                    _duration(status.age_s(t.newest_event_s)),
                    "-" if t.last_commit_s is None else f"{_duration(status.age_s(t.last_commit_s))} ago",
                    _cell(t.batch_id),
                    _cell(t.version),
                    _cell(t.rows),
                    _cell(t.quarantined),
                    _cell(t.late),
                    "ok" if t.healthy and not status.problems else "UNHEALTHY",
                )
            )
            if partitions:
                rows.extend(
                    ("", f"  [{p.partition}]", "", _cell(p.lag), f"applied {_cell(p.applied)}", f"end {_cell(p.end)}")
                    + ("",) * (len(COLUMNS) - 6)
                    for p in t.partitions
                )
            notes.extend(f"{status.replica}.{t.table}: {reason}" for reason in t.unhealthy)
            if t.fields_not_kept:
                fields = ", ".join(f"{name} ({n} records)" for name, n in sorted(t.fields_not_kept.items()))
                notes.append(
                    f"{status.replica}.{t.table}: fields the table does not keep were sent: {fields}; declare them in "
                    "the schema to keep them (see the README's Schema evolution)"
                )
            if t.late:
                notes.append(
                    f"{status.replica}.{t.table}: {t.late} late changes seen (a lower seq written after a higher one "
                    "for a key): a rebuild from a compacted topic may differ from this table; rebuild with --verify"
                )
    widths = [max(len(row[i]) for row in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    numeric = {3, 6, 7, 8, 9, 10}
    lines = [
        "  ".join(
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in [COLUMNS, *rows]
    ]
    return "\n".join(lines + notes)


def to_json(statuses: Iterable[ReplicaStatus]) -> str:
    """The statuses as one JSON document: ``{"healthy": ..., "replicas": [...]}``."""
    replicas = [s.to_dict() for s in statuses]
    return json.dumps({"healthy": all(r["healthy"] for r in replicas), "replicas": replicas}, indent=2)


STATUS_SCHEMA = T.StructType(
    [
        T.StructField("replica", T.StringType()),
        T.StructField("table", T.StringType()),
        T.StructField("topic", T.StringType()),
        T.StructField("partition", T.IntegerType()),
        T.StructField("applied", T.LongType()),
        T.StructField("end", T.LongType()),
        T.StructField("lag", T.LongType()),
        T.StructField("version", T.LongType()),
        T.StructField("last_commit_at", T.TimestampType()),
        T.StructField("newest_event_at", T.TimestampType()),
        T.StructField("healthy", T.BooleanType()),
    ]
)


def status_of(spark: SparkSession, cfg: ReplicaConfig, thresholds: Thresholds | None = None) -> ReplicaStatus:
    """:func:`replica_status` with a Kafka client made from the replica's own connection settings."""
    client = cfg.kafka.client_config()
    admin, reason = None, client.reason
    if client.settings is not None:
        try:
            admin = TopicAdmin(client.settings, timeout_s=10.0)
        except TopicError as exc:
            reason = str(exc)
    else:
        reason = f"the log's end offsets cannot be read here: {reason}"
    return replica_status(spark, cfg, admin, thresholds, no_admin_reason=reason)


def status_df(spark: SparkSession, statuses: Iterable[ReplicaStatus]) -> DataFrame:
    """The statuses as rows for SQL, one per replica, table and partition (e.g. ``createOrReplaceTempView``)."""

    def at(epoch_s: float | None) -> datetime | None:
        return None if epoch_s is None else datetime.fromtimestamp(epoch_s, UTC)

    rows = [
        (
            s.replica,
            t.table,
            t.topic,
            p.partition,
            p.applied,
            p.end,
            p.lag,
            t.version,
            at(t.last_commit_s),
            at(t.newest_event_s),
            t.healthy and not s.problems,
        )
        for s in statuses
        for t in s.tables
        for p in t.partitions
    ]
    return spark.createDataFrame(rows, STATUS_SCHEMA)
