"""Every Delta MERGE and write of the project, built here: version-gated, tombstone-aware, idempotent per batch.

Each write of batch ``b`` is a Delta idempotent write (``txnAppId``, ``txnVersion = b``): a batch that Spark
re-executes after a crash is skipped by Delta rather than applied twice. The batch's appends to the tombstone table
and to a change log can be made ``checked`` instead: the caller applies the same rule itself, without the Spark job
over the table's state that Delta's check runs on every commit. Each commit also carries the Kafka end
offsets of the batch in its ``userMetadata``, atomically with the data (see :mod:`replica_lib.progress`). The
one write that is neither is :func:`compact_files`: it changes files, never rows.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.types import StructType

from replica_lib.config import Target
from replica_lib.errors import (
    ConcurrentAppendError,
    ConcurrentCommitError,
    ConcurrentDeleteDeleteError,
    ConcurrentDeleteReadError,
    jvm_causes,
)
from replica_lib.ordering import LogOrder, key_json, log_order, newer
from replica_lib.session import java_class
from replica_lib.target import PROVENANCE_COLUMNS, TableSchema, delta_table, latest_snapshot, size_bytes

logger = logging.getLogger(__name__)

INTEGRAL_TYPES = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)

_TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
_MATERIALIZE_SOURCE = "spark.databricks.delta.merge.materializeSource"
#: The Spark conf that decides, when set, whether every MERGE writes deletion vectors (see REWRITE_MAX_BYTES).
MERGE_DELETION_VECTORS = "spark.databricks.delta.merge.deletionVectors.persistent"


@dataclass(frozen=True)
class Commit:
    """Identity of one idempotent write: which app (replica, table, checkpoint generation) and which batch."""

    app_id: str
    batch_id: int
    metadata: Mapping[str, Any]

    def user_metadata(self) -> str:
        return json.dumps(self.metadata, sort_keys=True, separators=(",", ":"))


@contextlib.contextmanager
def session_confs(spark: SparkSession, confs: Mapping[str, str]) -> Iterator[None]:
    """Set session confs for the block, then put back what was there (a user's own setting survives)."""
    previous: dict[str, str | None] = {key: spark.conf.get(key, None) for key in confs}
    for key, value in confs.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, before in previous.items():
            if before is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, before)


def idempotent(spark: SparkSession, commit: Commit) -> contextlib.AbstractContextManager[None]:
    """Session confs that make the DML inside an idempotent Delta write carrying the commit's metadata."""
    return session_confs(
        spark, {_TXN_APP_ID: commit.app_id, _TXN_VERSION: str(commit.batch_id), _USER_METADATA: commit.user_metadata()}
    )


def _on_keys(keys: tuple[str, ...]) -> Column:
    condition = None
    for key in keys:
        term = F.col(f"t.`{key}`") == F.col(f"s.`{key}`")
        condition = term if condition is None else condition & term
    assert condition is not None
    return condition


def _source_newer(by_log: LogOrder | None, keys: Sequence[str]) -> Column:
    across = None
    if by_log is not None:
        across = by_log.refusal(key_json(keys, "s."), F.col("s._partition"), F.col("t._src_partition"))
    return newer(
        F.col("s._seq"),
        F.col("s._partition"),
        F.col("s._offset"),
        F.col("t._src_seq"),
        F.col("t._src_partition"),
        F.col("t._src_offset"),
        across,
    )


_PROVENANCE_SOURCES = tuple(
    zip(PROVENANCE_COLUMNS, ("s._topic", "s._partition", "s._offset", "s._seq", "s._event_ts"), strict=True)
)


def _provenance() -> dict[str, Column]:
    return {name: F.col(src) for name, src in _PROVENANCE_SOURCES}


@dataclass(frozen=True)
class Applied:
    """What one write did to a table: rows inserted or updated, and rows deleted."""

    upserted: int = 0
    deleted: int = 0


@dataclass(frozen=True)
class KeyRange:
    """The smallest and greatest value of a single key column among a batch's changes.

    Added to the MERGE condition as a target-only predicate, it lets Delta skip every file whose key statistics
    lie outside the range (data skipping), so a batch of recent keys does not scan the whole table.
    """

    column: str
    low: Any  # a value, or a literal Column of the key's type
    high: Any

    def condition(self, prefix: str = "t") -> Column:
        return F.col(f"{prefix}.`{self.column}`").between(F.lit(self.low), F.lit(self.high))


def _applied(metrics_df: DataFrame) -> Applied:
    rows = metrics_df.collect()
    if not rows:  # Delta skipped a write it had already committed (same txnAppId and txnVersion)
        return Applied()
    row = rows[0].asDict()
    return Applied(
        upserted=int(row.get("num_updated_rows") or 0) + int(row.get("num_inserted_rows") or 0),
        deleted=int(row.get("num_deleted_rows") or 0),
    )


def _source(winners_df: DataFrame, rows: int) -> DataFrame:
    # A batch's winners are few next to the table: broadcast them, so the MERGE's join never shuffles the table.
    return F.broadcast(winners_df) if rows <= BROADCAST_ROWS else winners_df


BROADCAST_ROWS = 200_000

#: A MERGE into a table of at most this size rewrites the files it touches; into a larger one it marks the rows it
#: replaces with deletion vectors. Deletion vectors spare a large table's untouched rows from being rewritten, but
#: each MERGE pays for them in Spark jobs of its own (seven, on a 20,000-row batch), which cost more than
#: rewriting a small table outright. Rewriting touches at most this much, so about a second of I/O. Setting
#: ``spark.databricks.delta.merge.deletionVectors.persistent`` in the job's Spark conf decides for every MERGE.
REWRITE_MAX_BYTES = 64 << 20


def _deletion_vectors(spark: SparkSession, target: Target) -> bool:
    """Whether a MERGE into ``target`` now should write deletion vectors (see :data:`REWRITE_MAX_BYTES`)."""
    return (size_bytes(spark, target) or 0) > REWRITE_MAX_BYTES


#: A MERGE that writes deletion vectors reads the target's touched files joined to the winners by an outer join
#: that keeps every winner, which Spark cannot broadcast, so it shuffles every row of those files; with uniform
#: keys, every row of the table. Up to this many winners of an integral key, the condition also lists their keys
#: (:func:`key_list`): Spark pushes that filter into the target's side of the join, and only matched rows are
#: shuffled. The list's cost grows with it (every plan of the MERGE and its recorded predicate carry it): past a few
#: thousand keys it costs more than the shuffle it spares (docs/performance.md).
KEY_LIST_MAX = 2_000


def key_list(winners_df: DataFrame, schema: TableSchema, rows: int, prefix: str = "t") -> Column | None:
    """``<prefix>.key IN (…)`` over the winners' keys, for a table of one integral key and at most
    :data:`KEY_LIST_MAX` winners; None otherwise. Redundant with the key equality, so it changes no match."""
    keys = schema.table.keys
    if len(keys) != 1 or rows > KEY_LIST_MAX:
        return None
    if not isinstance(schema.key_schema.fields[0].dataType, INTEGRAL_TYPES):
        return None
    values = sorted({int(row[0]) for row in winners_df.select(F.col(f"`{keys[0]}`")).collect() if row[0] is not None})
    if not values:
        return None
    return F.expr(f"{prefix}.`{keys[0]}` IN ({', '.join(str(v) for v in values)})")


def merge_rows(
    spark: SparkSession,
    target: Target,
    winners_df: DataFrame,
    schema: TableSchema,
    commit: Commit,
    rows: int,
    key_range: KeyRange | None = None,
) -> Applied:
    """Apply one winning change per key to the replica table: newer deletes delete, newer upserts upsert.

    ``winners_df`` must be materialized (a local checkpoint): the MERGE reads it twice and does not copy it.
    ``rows`` is the number of winners; ``key_range`` (optional) bounds the files the MERGE reads.
    """
    is_delete, is_upsert = F.col("s._op") == "delete", F.col("s._op") == "upsert"
    source_newer = _source_newer(log_order(schema.table), schema.table.keys)
    values = {f"`{f.name}`": F.col(f"s.`{f.name}`") for f in schema.kept.fields} | _provenance()
    on = _on_keys(schema.table.keys)
    if key_range is not None:
        on = on & key_range.condition()
    # The winners are materialized already (a local checkpoint, the same rows however often it is read); Delta
    # would otherwise copy them once more (to disk), as it does for any MERGE source that is not a Delta table.
    confs = {_MATERIALIZE_SOURCE: "none"}
    if not schema.table.deletion_vectors:  # a table without them: the MERGE rewrites, and asking costs a job
        confs[MERGE_DELETION_VECTORS] = "false"
        vectors = False
    else:
        own = spark.conf.get(MERGE_DELETION_VECTORS, None)  # a setting of the user's own stands
        vectors = _deletion_vectors(spark, target) if own is None else own.strip().lower() == "true"
        if own is None:
            confs[MERGE_DELETION_VECTORS] = str(vectors).lower()
    listed = key_list(winners_df, schema, rows) if vectors else None
    if listed is not None:
        on = on & listed
    with idempotent(spark, commit), session_confs(spark, confs):
        metrics = (
            delta_table(spark, target)
            .alias("t")
            .merge(_source(winners_df, rows).alias("s"), on)
            .whenMatchedDelete(condition=is_delete & source_newer)
            .whenMatchedUpdate(condition=is_upsert & source_newer, set=values)
            .whenNotMatchedInsert(condition=is_upsert, values=values)
            .execute()
        )
    return _applied(metrics)


def append_rows(
    target: Target, winners_df: DataFrame, schema: TableSchema, commit: Commit, upserts: int | None = None
) -> Applied:
    """The bulk path, for a table that is still empty (a rebuild): append the upserts, no MERGE needed.

    ``upserts``: how many the winners hold, if the caller counted them already (else a job counts them)."""
    upserts_df = winners_df.where(F.col("_op") == "upsert")
    columns = [F.col(f"`{f.name}`") for f in schema.kept.fields]
    provenance = [F.col(src[2:]).alias(name) for name, src in _PROVENANCE_SOURCES]
    _append(target, upserts_df.select(*columns, *provenance), commit)
    return Applied(upserted=upserts_df.count() if upserts is None else upserts)


def append_tombstones(
    target: Target, winners_df: DataFrame, schema: TableSchema, commit: Commit, checked: bool = False
) -> None:
    """Retain the batch's winning deletes: an append to the tombstone log (see ``batch._winners``).

    ``checked``: the caller knows the commit is not in the log yet, so Delta's idempotence check is skipped: that
    check reads the table's transactions from a full snapshot state, a Spark job over its log on every commit.
    The rows still carry ``_app_id`` and ``_batch_id``, which is what the caller checks.
    """
    deletes = winners_df.where(F.col("_op") == "delete")
    provenance = [F.col(src[2:]).alias(name) for name, src in _PROVENANCE_SOURCES]
    _append(
        target,
        deletes.select(
            *[F.col(f"`{k}`") for k in schema.table.keys],
            *provenance,
            F.current_timestamp().alias("_deleted_at"),
            F.lit(commit.app_id).alias("_app_id"),
            F.lit(commit.batch_id).cast("long").alias("_batch_id"),
        ),
        commit,
        txn=not checked,
    )


def append_changes(
    target: Target, winners_df: DataFrame, schema: TableSchema, commit: Commit, generation: str, checked: bool = False
) -> None:
    """Log a batch's winners in a merge-on-read table's change log (an idempotent append; see replica_lib.layout).

    ``checked``: the caller knows the batch is not in the log yet, so Delta's idempotence check, a Spark job over
    the log's state on every commit, is skipped (as for :func:`append_tombstones`).
    """
    columns = [F.col(f"`{f.name}`") for f in schema.kept.fields]
    provenance = [F.col(src[2:]).alias(name) for name, src in _PROVENANCE_SOURCES]
    _append(
        target,
        winners_df.select(
            *columns,
            *provenance,
            F.col("_op"),
            F.lit(generation).alias("_generation"),
            F.lit(commit.batch_id).cast("long").alias("_batch_id"),
        ),
        commit,
        txn=not checked,
    )


def retire_changes(spark: SparkSession, target: Target, folded: Mapping[str, int]) -> None:
    """Delete from a change log the changes a fold applied: per checkpoint generation, batches up to its mark.

    Batch ids grow within a generation, so nothing appended after the fold read the log matches; deleting the same
    changes again deletes nothing, so a fold killed before this point retires them when it runs again.
    """
    condition = " OR ".join(
        f"(_generation = '{generation}' AND _batch_id <= {int(batch_id)})" for generation, batch_id in folded.items()
    )
    if condition:
        delta_table(spark, target).delete(condition)


def append_quarantine(target: Target, rows_df: DataFrame, commit: Commit) -> None:
    """Append rejected records to the quarantine table (an idempotent append)."""
    _append(target, rows_df, commit)


def append_resolved(target: Target, rows_df: DataFrame) -> None:
    """Record quarantined records as replayed or dropped (a plain append: recording one twice changes nothing)."""
    writer = rows_df.write.format("delta").mode("append")
    if target.path:
        writer.save(target.path)
    else:
        writer.saveAsTable(str(target.table))


def append_metrics(
    spark: SparkSession, target: Target, rows: Sequence[tuple[Any, ...]], schema: StructType, commit: Commit
) -> None:
    """Append per-batch metrics records (skipped if a write of the same app reached ``commit.batch_id``); a table
    from before a column was added gains it."""
    _append(target, spark.createDataFrame(list(rows), schema), commit, merge_schema=True)


def replace_rows(target: Target, rows_df: DataFrame, commit: Commit) -> None:
    """Replace a table's rows with ``rows_df`` in one commit (an idempotent overwrite).

    Readers see the old rows or the new, never a mix; the table keeps its id, properties and history, so time
    travel still reaches the old rows.
    """
    _append(target, rows_df, commit, mode="overwrite")


def _append(
    target: Target,
    rows_df: DataFrame,
    commit: Commit,
    mode: str = "append",
    merge_schema: bool = False,
    txn: bool = True,
) -> None:
    writer = (
        rows_df.write.format("delta")
        .mode(mode)
        .option("mergeSchema", str(merge_schema).lower())
        .option("userMetadata", commit.user_metadata())
    )
    if txn:  # Delta skips the write if this app's commit of this batch (or a later one) is in the table already
        writer = writer.option("txnAppId", commit.app_id).option("txnVersion", commit.batch_id)
    if target.path:
        writer.save(target.path)
    else:
        writer.saveAsTable(str(target.table))


#: Delta's JVM classes for a commit that lost a race, most specific first, and the error each is raised as here.
_CONFLICTS: tuple[tuple[str, type[ConcurrentCommitError]], ...] = (
    ("io.delta.exceptions.ConcurrentAppendException", ConcurrentAppendError),
    ("io.delta.exceptions.ConcurrentDeleteReadException", ConcurrentDeleteReadError),
    ("io.delta.exceptions.ConcurrentDeleteDeleteException", ConcurrentDeleteDeleteError),
    ("io.delta.exceptions.DeltaConcurrentModificationException", ConcurrentCommitError),  # any other kind
)


def delta_conflict(exc: BaseException) -> ConcurrentCommitError | None:
    """``exc`` as the typed error of a commit Delta refused for a concurrent one (its causes too), else None.

    Importing ``delta.tables`` patches PySpark's error conversion so that a conflict thrown by a Delta call
    arrives as a ``delta.exceptions`` class; a conflict that reaches Python another way (wrapped in another JVM
    exception, or through a plain py4j call) arrives as a ``Py4JJavaError`` or a ``CapturedException`` holding
    the JVM exception, whose class (and its causes' classes) tells the kinds apart.
    """
    import delta.exceptions as delta_errors
    from py4j.java_gateway import is_instance_of
    from pyspark import SparkContext

    # delta.exceptions' classes are siblings, not a hierarchy: every other kind is a plain concurrent commit.
    converted: tuple[tuple[type[BaseException], type[ConcurrentCommitError]], ...] = (
        (delta_errors.ConcurrentAppendException, ConcurrentAppendError),
        (delta_errors.ConcurrentDeleteReadException, ConcurrentDeleteReadError),
        (delta_errors.ConcurrentDeleteDeleteException, ConcurrentDeleteDeleteError),
        (delta_errors.ConcurrentTransactionException, ConcurrentCommitError),
        (delta_errors.ConcurrentWriteException, ConcurrentCommitError),
        (delta_errors.MetadataChangedException, ConcurrentCommitError),
        (delta_errors.ProtocolChangedException, ConcurrentCommitError),
        (delta_errors.DeltaConcurrentModificationException, ConcurrentCommitError),
    )
    for python_class, error in converted:
        if isinstance(exc, python_class):
            message = str(getattr(exc, "_desc", None) or python_class.__name__).strip().splitlines()
            return error(message[0] if message else python_class.__name__)
    gateway = SparkContext._gateway
    for cause in jvm_causes(exc):
        for jvm_class, error in _CONFLICTS:
            if is_instance_of(gateway, cause, jvm_class):
                return error(str(cause.getMessage()).splitlines()[0])
    return None


@contextlib.contextmanager
def typed_conflicts() -> Iterator[None]:
    """Raise a Delta commit refused for a concurrent one as a :class:`ConcurrentCommitError` (by its kind)."""
    try:
        yield
    except Exception as exc:
        conflict = delta_conflict(exc)
        if conflict is None:
            raise
        raise conflict from exc


#: The size OPTIMIZE packs small files up to (Delta's auto compaction aims at the same).
COMPACTED_FILE_BYTES = 128 << 20
_OPTIMIZE_MIN_FILE_SIZE = "spark.databricks.delta.optimize.minFileSize"
_OPTIMIZE_MAX_FILE_SIZE = "spark.databricks.delta.optimize.maxFileSize"


@dataclass(frozen=True)
class Compacted:
    """What one compaction did to a table's files (both 0: nothing to pack, and no commit)."""

    removed: int
    added: int


def compact_files(spark: SparkSession, target: Target, small_file_bytes: int) -> Compacted | None:
    """Pack a table's files smaller than ``small_file_bytes`` into files of up to 128 MB (Delta OPTIMIZE).

    Larger files stay, unless deletion vectors mark enough of their rows for OPTIMIZE to purge them. The commit
    changes no row (``dataChange = false``), so it carries no batch: the offsets stay those of the last batch.
    Returns None, after a warning, when a concurrent commit on the table made Delta refuse it (maintenance
    deleting retained deletes, an operator's OPTIMIZE): the next compaction packs these files too.
    """
    confs = {_OPTIMIZE_MIN_FILE_SIZE: str(small_file_bytes), _OPTIMIZE_MAX_FILE_SIZE: str(COMPACTED_FILE_BYTES)}
    return _optimize(spark, target, confs, lambda optimize: optimize.executeCompaction(), "compacting")


def zorder_files(spark: SparkSession, target: Target, columns: Sequence[str]) -> Compacted | None:
    """Rewrite every file of a table, its rows ordered along ``columns`` (Delta OPTIMIZE ZORDER BY), in files of
    up to 128 MB: each file then holds a narrow range of keys, so a lookup or a MERGE by key skips the others.

    Like :func:`compact_files`, a commit that changes no row; None, after a warning, when a concurrent commit won.
    """
    confs = {_OPTIMIZE_MAX_FILE_SIZE: str(COMPACTED_FILE_BYTES)}
    return _optimize(spark, target, confs, lambda optimize: optimize.executeZOrderBy(*columns), "z-ordering")


def checkpoint(spark: SparkSession, target: Target) -> None:
    """Write a checkpoint of a table's log at its latest version: what Delta writes inside the commits whose
    version is a multiple of ``delta.checkpointInterval``, here at a time the caller chooses (a change log's,
    after its fold: ``replica_lib.layout.fold``). It changes no row and commits nothing."""
    snapshot = latest_snapshot(spark, target)
    if snapshot is not None:
        snapshot.deltaLog().checkpoint(snapshot, java_class(spark, "scala.Option").empty())


def _optimize(
    spark: SparkSession, target: Target, confs: Mapping[str, str], run: Callable[[Any], DataFrame], what: str
) -> Compacted | None:
    try:
        with session_confs(spark, confs), typed_conflicts():
            metrics = run(delta_table(spark, target).optimize())
            row = metrics.select("metrics.numFilesRemoved", "metrics.numFilesAdded").first()
    except ConcurrentCommitError as conflict:
        logger.warning(
            "%s %s: a concurrent commit won, packed at the next compaction (%s: %s)",
            what,
            target.describe(),
            type(conflict).__name__,
            conflict,
        )
        return None
    return Compacted(0, 0) if row is None else Compacted(int(row[0] or 0), int(row[1] or 0))


_RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"
#: Delta 4.4 ignores a VACUUM's retention other than 0 hours unless this is off, and keeps the table's
#: ``delta.deletedFileRetentionDuration`` instead: a longer retention asked for, or the floor kept while the replica
#: runs, would delete files that it was asked to keep.
_RETENTION_IGNORED = "spark.databricks.delta.vacuum.retentionWindowIgnore.enabled"
_VACUUM_LOGGING = "spark.databricks.delta.vacuum.logging.enabled"
_LISTING_PARALLELISM = "spark.sql.sources.parallelPartitionDiscovery.parallelism"


def vacuum_files(spark: SparkSession, target: Target, retain_hours: float) -> int | None:
    """Delete the files of ``target`` that no version of the last ``retain_hours`` hours references (VACUUM).

    The caller has checked the retention (:func:`replica_lib.maintenance.vacuum_retention`), so Delta's own check,
    which refuses less than a week whatever the table's settings, is off for this call, and Delta keeps
    ``retain_hours``, not the table's window (:data:`_RETENTION_IGNORED`). Returns the files
    deleted, from the ``VACUUM END`` commit that Delta logs with this session's settings (None if there is none).
    """
    confs = {_RETENTION_CHECK: "false", _RETENTION_IGNORED: "false", _VACUUM_LOGGING: "true"}
    if spark.conf.get(_LISTING_PARALLELISM, None) is None:  # a setting of the user's own stands
        # VACUUM lists the table's folders in this many tasks, by default 10,000: 15 s for an empty table on two
        # cores. The cluster's cores list a table of any size as fast.
        confs[_LISTING_PARALLELISM] = str(max(1, spark.sparkContext.defaultParallelism))
    with session_confs(spark, confs):
        delta_table(spark, target).vacuum(retain_hours)
    for row in delta_table(spark, target).history(2).select("operation", "operationMetrics").collect():
        if row["operation"] == "VACUUM END":
            return int((row["operationMetrics"] or {}).get("numDeletedFiles", 0))
    return None


def delete_matching(spark: SparkSession, target: Target, rows_df: DataFrame, columns: tuple[str, ...]) -> int:
    """Delete the rows of ``target`` equal to a row of ``rows_df`` on ``columns``; returns how many were deleted."""
    on = _on_keys(columns)
    metrics = delta_table(spark, target).alias("t").merge(rows_df.alias("s"), on).whenMatchedDelete().execute()
    return _applied(metrics).deleted


def delete_where(spark: SparkSession, target: Target, condition: str) -> int:
    """Delete the rows matching ``condition``; returns how many were deleted."""
    table = delta_table(spark, target)
    table.delete(condition)
    metrics = table.history(1).select("operationMetrics").collect()[0]["operationMetrics"] or {}
    return int(metrics.get("numDeletedRows", 0))
