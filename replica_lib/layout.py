"""Merge-on-read: a table's batches go to a change log, a fold applies them to the table, a view shows the state.

A merge-on-read table is three Delta tables: the **base** (the table's rows as of the last fold, what a
copy-on-write table holds), its **change log** (``<target>__changes``: each batch's winning change per key,
appended without reading anything) and its retained deletes (as for copy-on-write). A batch costs an append.
The **state** is the greatest version per key among the base row, the pending changes and the retained deletes,
where it is not a delete: :func:`state_sql` says so in SQL, and any engine that reads Delta can run it.

The **fold** applies the pending changes to the base with the same version-gated MERGE as copy-on-write, then
deletes them from the change log. Every step is safe to repeat: the MERGE and the tombstone append are idempotent
writes keyed by the change log's version, and the retirement deletes changes that the base already holds. Until a
fold retires them, the view ranks the pending changes against the base, so a fold killed at any point never shows
readers a wrong state.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from replica_lib.config import TableConfig, Target
from replica_lib.errors import ConcurrentAppendError
from replica_lib.merge import (
    Commit,
    KeyRange,
    append_tombstones,
    checkpoint,
    merge_rows,
    retire_changes,
    typed_conflicts,
)
from replica_lib.ordering import log_order, one_per_key, unapplied
from replica_lib.progress import SWAP_GENERATION, applied_offsets, offsets_json
from replica_lib.target import (
    CHANGE_LOG_PARTITIONS,
    PROVENANCE_COLUMNS,
    TableSchema,
    changes_target,
    current_schema,
    delta_table,
    file_count,
    latest_version,
    log_state,
    partition_columns,
    read_table,
    size_bytes,
    sql_string,
    sql_type,
    tombstone_target,
    user_columns,
    version_columns,
)

logger = logging.getLogger(__name__)

#: The named points of a fold, in order, for the fault harness (see ``replica_lib.batch.BatchHooks``).
FOLD_POINTS = ("after_fold_tombstones", "after_fold_merge")

# Key types whose min/max Delta keeps as file statistics (so a key range can skip files).
RANGE_TYPES = (T.NumericType, T.StringType, T.DateType, T.TimestampType)


def _quote(name: str) -> str:
    return f"`{name}`"


def state_sql(schema: TableSchema, base: str, changes: str, tombstones: str, whole: bool = False) -> str:
    """The state of a merge-on-read table as one SQL query over its three tables (names or ``delta.`path```).

    Keys without pending changes read the base as it is (no ranking, no shuffle of the base); only the keys
    that have some are ranked, among their pending changes, base row and retained deletes. The base and the
    deletes are matched against the change log itself: a semi or anti join needs no distinct build side (a
    ``DISTINCT`` of the keys would cost a shuffle and a Spark job in every query).

    ``whole``: rank every key instead, among its base row, pending changes and every retained delete, so that
    each of the three tables is read once: each read of a table costs Spark a listing of its files,
    one more at each step of the query's adaptive plan for a table with deletion vectors, which outweighs
    shuffling a small table's rows (see :data:`WHOLE_MAX_BYTES`). Both shapes give the same rows.

    A table ordered by log position (no ``sequence_by``) ranks a key only among changes of one partition: the
    query fails (Spark's ``raise_error``, as :class:`~replica_lib.ordering.LogOrder` fails a batch) for a key whose
    candidates come from two, rather than show one of them. Another engine puts its own error function there.

    A query of the catalog's view cannot pin the change log's version as :func:`read_state` does, so it must take
    the change log's snapshot before the base's and the retained deletes' (a fold writes those two before it
    retires the changes it applied, so every change is then in one of the reads). Delta takes the snapshot each
    table's files are read from in its optimizer rule ``PrepareDeltaScan`` (not at analysis, whose snapshot gives
    the schema only), one per table for the whole query, visiting subqueries first and then the plan from the top:
    here the ``EXISTS`` subqueries, which read the change log alone, or in the whole shape the ``UNION`` whose first
    branch is the change log. That holds with Delta's defaults (``spark.databricks.delta.stats.skipping`` on,
    ``stalenessLimit`` 0), read in Delta 4.4's and Spark 4.2's sources.
    """
    keys = list(schema.table.keys)
    columns = [f.name for f in schema.replica_schema.fields]
    cols = ", ".join(_quote(c) for c in columns)
    key_list = ", ".join(_quote(k) for k in keys)

    def pending(alias: str) -> str:
        same_key = " AND ".join(f"p.{_quote(k)} = {alias}.{_quote(k)}" for k in keys)
        return f"EXISTS (SELECT 1 FROM {changes} p WHERE {same_key})"

    as_delete = ", ".join(
        _quote(f.name)
        if f.name in keys or f.name in PROVENANCE_COLUMNS
        else f"CAST(NULL AS {sql_type(f.dataType)}) AS {_quote(f.name)}"
        for f in schema.replica_schema.fields
    )
    base_rows = f"SELECT {cols}, 'upsert' AS _op FROM {base} b" + ("" if whole else f" WHERE {pending('b')}")
    winner = "_rank = 1 AND _op = 'upsert'"
    by_log = log_order(schema.table)
    by_version = f"PARTITION BY {key_list} ORDER BY _src_seq DESC NULLS LAST, _src_partition DESC, _src_offset DESC"
    partitions = ""
    if by_log is not None:  # one CASE, so that no filter runs before it and skips a key's check
        whole_key = f"OVER ({by_version} ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)"
        partitions = f", MIN(_src_partition) {whole_key} AS _low, MAX(_src_partition) {whole_key} AS _high"
        key = f"to_json(named_struct({', '.join(f'{sql_string(k)}, {_quote(k)}' for k in keys)}))"
        winner = f"CASE WHEN _low <> _high THEN {by_log.refusal_sql(key, '_low', '_high')} ELSE {winner} END"
    ranked = f"""WITH candidates AS (
  SELECT {cols}, _op FROM {changes}
  UNION ALL
  {base_rows}
  UNION ALL
  SELECT {as_delete}, 'delete' AS _op FROM {tombstones} d{"" if whole else f" WHERE {pending('d')}"}
),
ranked AS (
  SELECT *, ROW_NUMBER() OVER ({by_version}) AS _rank{partitions}
  FROM candidates
)
"""
    if whole:
        return f"{ranked}SELECT {cols} FROM ranked WHERE {winner}"
    return f"""{ranked}SELECT {cols} FROM {base} b WHERE NOT {pending("b")}
UNION ALL
SELECT {cols} FROM ranked WHERE {winner}"""


#: A base and retained deletes of at most this size together are ranked whole (``state_sql(whole=True)``) by
#: :func:`read_state`. Measured on 2 cores, 20 changes pending, bases of 0.3M/1M/3M rows (2/8/25 MB): a point
#: lookup 0.47/0.40/0.35 s ranked whole against 1.18/0.83/0.83 s (its key's filter reaches every read), an
#: aggregate 0.78/0.91/1.70 s against 1.67/1.10/1.13 s: past a few million rows, shuffling them all costs more.
WHOLE_MAX_BYTES = 32 << 20


def read_state(spark: SparkSession, table: TableConfig, changes_version: int | None = None) -> DataFrame:
    """A table's state: a copy-on-write table's rows, a merge-on-read table's :func:`state_sql`.

    By default the latest state: the change log's latest version, taken before the base and the retained deletes
    are read as they are now, which is exact, since a fold writes those two before it retires the changes it
    applied (a fold may run beside). ``changes_version``: the state at that version of the change log (a time
    travel, :mod:`replica_lib.reads`): the base and the retained deletes are read as they were before the first
    fold of changes appended after it, or the first swap that replaced them after it (:func:`_before_folds_past`),
    and each at its own columns of then.
    """
    if not table.merge_on_read:
        return read_table(spark, table.target)
    log = None
    if changes_version is None:
        log = log_state(spark, changes_target(table))
        if log is None or not log.files:
            return read_table(spark, table.target)  # nothing pending: the table is the state (a fold only adds to it)
    schema = current_schema(spark, table)  # the columns added from the data since, too
    deletes = tombstone_target(table)
    sizes = [size_bytes(spark, target) for target in (table.target, deletes)]
    whole = all(size is not None for size in sizes) and sum(size or 0 for size in sizes) <= WHOLE_MAX_BYTES
    if log is not None:
        changes = f"{changes_target(table).describe()} VERSION AS OF {int(log.version)}"
        return spark.sql(state_sql(schema, table.target.describe(), changes, deletes.describe(), whole))
    assert changes_version is not None
    swaps = _swaps_after(spark, changes_target(table), changes_version)
    base_version = _before_folds_past(spark, table.target, changes_version, swaps)
    deletes_version = _before_folds_past(spark, deletes, changes_version, swaps)
    return spark.sql(
        state_sql(
            schema,
            _as_of(spark, table.target, base_version, schema),
            _as_of(spark, changes_target(table), changes_version, schema),
            deletes.describe() + ("" if deletes_version is None else f" VERSION AS OF {deletes_version}"),
            whole,
        )
    )


def _before_folds_past(
    spark: SparkSession, target: Target, changes_version: int, swaps: frozenset[str] = frozenset()
) -> int | None:
    """The last version of a merge-on-read table's base (or retained deletes) before the first fold that read its
    change log past ``changes_version`` or the first commit of one of ``swaps``; None if there is neither (the
    latest version is then exact)."""
    history = delta_table(spark, target).history().select("version", "userMetadata").orderBy("version").collect()
    for row in history:
        read = _fold_read(row["userMetadata"])
        if (read is not None and read > changes_version) or _generation(row["userMetadata"]) in swaps:
            return int(row["version"]) - 1
    return None


def _swaps_after(spark: SparkSession, changes: Target, changes_version: int) -> frozenset[str]:
    """The generations of the swaps (:mod:`replica_lib.swap`) that replaced the change log after
    ``changes_version``: a swap replaces the retained deletes and the base first, in commits of the same
    generation, which a state at that version must be read before."""
    history = delta_table(spark, changes).history().where(f"version > {int(changes_version)}").collect()
    generations = (_generation(row["userMetadata"]) for row in history)
    return frozenset(g for g in generations if g is not None and g.startswith(SWAP_GENERATION))


def _metadata(user_metadata: str | None) -> dict[str, Any]:
    """A commit's metadata as the replica writes it (a JSON object), or empty for any other commit."""
    try:
        metadata = json.loads(user_metadata or "")
    except ValueError:
        return {}
    return metadata if isinstance(metadata, dict) else {}


def _generation(user_metadata: str | None) -> str | None:
    """The generation a replica commit records (a checkpoint's, or a swap's ``swap-<id>``), else None."""
    generation = _metadata(user_metadata).get("generation")
    return str(generation) if generation is not None else None


def _fold_read(user_metadata: str | None) -> int | None:
    """The change log version a fold's commit says it read (``read``; a fold before it was recorded, the version of
    the last batch it folded), or None for another commit."""
    metadata = _metadata(user_metadata)
    if "folded" not in metadata:
        return None
    return int(metadata["read"] if "read" in metadata else metadata["folded"])


def _as_of(spark: SparkSession, target: Target, version: int | None, schema: TableSchema) -> str:
    """``target`` at ``version`` (None: its latest) as a relation of the state's columns: those it did not have then
    (added from the data since) read as nulls."""
    relation = target.describe() + ("" if version is None else f" VERSION AS OF {int(version)}")
    then = spark.sql(f"SELECT * FROM {relation}").columns
    if all(f.name in then for f in schema.replica_schema.fields):
        return relation
    columns = [
        _quote(f.name) if f.name in then else f"CAST(NULL AS {sql_type(f.dataType)}) AS {_quote(f.name)}"
        for f in schema.replica_schema.fields
    ]
    columns += ["_op"] if "_op" in then else []  # a change log's
    return f"(SELECT {', '.join(columns)} FROM {relation})"


@dataclass(frozen=True)
class Folded:
    """What one fold did: the change log version it folded, the changes applied and the rows they changed."""

    version: int | None  # the change log's version of the last batch folded; None if nothing was pending
    keys: int = 0  # keys with pending changes
    upserted: int = 0
    deleted: int = 0

    def line(self, table: str) -> str:
        if self.version is None:
            return f"fold {table}: nothing pending"
        return (
            f"fold {table}: changes of {self.keys} keys up to change log version {self.version}: "
            f"{self.upserted} rows upserted, {self.deleted} deleted, the changes retired"
        )


def fold_app_id(replica: str, table: str) -> str:
    """Delta ``txnAppId`` of a table's folds (every checkpoint generation's changes fold under it)."""
    return f"replica:{replica}:{table}:fold"


def fold(
    spark: SparkSession,
    replica: str,
    schema: TableSchema,
    at: Callable[[str], None] | None = None,
    retiring: AbstractContextManager[object] | None = None,
) -> Folded:
    """Apply a merge-on-read table's pending changes to its base, then retire them from the change log.

    The writes are keyed by the change log's version that the fold read (``txnVersion``): a fold that is run
    again after a crash skips what it committed. Safe beside a running replica, which only appends to the
    change log; two folds at once may conflict, and the loser's changes are folded by the next fold.

    ``retiring``: held while the applied changes are retired from a change log that is not partitioned by batch
    (one created before :data:`~replica_lib.target.CHANGE_LOG_PARTITIONS`): Delta refuses a DELETE of its rows when
    a batch appended to it meanwhile, and :func:`retire` tries again then; a replica that folds beside its
    batches holds its appends back with it. A partitioned change log's retirement removes whole partitions, which
    Delta does not refuse then: it takes no lock, and no batch waits for it.
    """
    table = schema.table
    log = changes_target(table)
    latest = delta_table(spark, log).history(1).select("version").first()
    assert latest is not None
    pending = read_table(spark, log, int(latest[0]))
    schema = _as_logged(spark, schema, pending.schema)
    marks = {
        str(row["_generation"]): int(row["_batch_id"])
        for row in pending.groupBy("_generation").agg(F.max("_batch_id").alias("_batch_id")).collect()
    }
    if not marks:
        return Folded(None)
    applied = applied_offsets(spark, log, int(latest[0]))
    assert applied is not None, f"{log.describe()} holds changes but no commit of a replica"
    metadata = {
        "replica": applied.replica,
        "batch_id": applied.batch_id,
        "generation": applied.generation,
        "offsets": offsets_json(applied.offsets),
        "folded": applied.version,
        "read": int(latest[0]),  # the change log's version read: a time travel before it reads the tables before this
    }
    keys = list(table.keys)
    changes = pending.select(
        *[
            F.col(_quote(f.name)) if f.name in pending.columns else F.lit(None).cast(f.dataType).alias(f.name)
            for f in schema.kept.fields
        ],
        *[F.col(name).alias(name.replace("_src", "", 1)) for name in PROVENANCE_COLUMNS],
        F.col("_op"),
        F.lit(False).alias("_tombstone"),
        F.lit(None).cast("string").alias("_error"),
    )
    winners = one_per_key(changes, keys, by_log=log_order(table)).localCheckpoint()
    counted = winners.agg(
        F.count(F.lit(1)).alias("rows"),
        F.min(F.col(_quote(keys[0]))).cast("string").alias("low"),  # cast after: a string orders otherwise
        F.max(F.col(_quote(keys[0]))).cast("string").alias("high"),
    ).first()
    assert counted is not None
    rows = int(counted["rows"])
    key_type = schema.key_schema.fields[0].dataType
    key_range = None
    if len(keys) == 1 and isinstance(key_type, RANGE_TYPES):
        key_range = KeyRange(keys[0], F.lit(counted["low"]).cast(key_type), F.lit(counted["high"]).cast(key_type))
    # A late upsert older than a retained delete of its key must not bring the row back; a delete always goes
    # to the MERGE, which deletes the row only if the delete is newer (and a re-run finds its own retained copy).
    upserts = winners.where(F.col("_op") == "upsert")
    retained = None  # before the first fold there are none (and Spark would drop the join, warning of its hint)
    if file_count(spark, tombstone_target(table)):
        retained = read_table(spark, tombstone_target(table)).select(*version_columns(table.keys))
        retained = retained.join(F.broadcast(upserts.select(*keys)), keys, "left_semi")
    gated = unapplied(upserts, keys, retained, log_order(table)).unionByName(winners.where(F.col("_op") == "delete"))
    gated = gated.localCheckpoint()

    app = fold_app_id(replica, table.name)
    # Keyed by the change log's version read, not by its last replica commit's: changes appended with no offsets
    # (a replay of quarantined records) come after that commit, and a fold keyed by it would be skipped as done.
    folded_version = int(latest[0])
    with typed_conflicts():
        tombstones = Commit(f"{app}:tombstones", folded_version, metadata)
        append_tombstones(tombstone_target(table), gated, schema, tombstones)
        if at is not None:
            at(FOLD_POINTS[0])
        commit = Commit(app, folded_version, metadata)
        merged = merge_rows(spark, table.target, gated, schema, commit, rows, key_range)
        if at is not None:
            at(FOLD_POINTS[1])
    by_batch = partition_columns(spark, log) == CHANGE_LOG_PARTITIONS
    with retiring if retiring is not None and not by_batch else contextlib.nullcontext():
        retire(spark, table, marks)
    checkpoint(spark, log)  # here, beside the batches, not inside a batch's append (target.CHANGE_LOG_CHECKPOINTS)
    return Folded(applied.version, rows, merged.upserted, merged.deleted)


def _as_logged(spark: SparkSession, schema: TableSchema, logged: T.StructType) -> TableSchema:
    """``schema``, or the table's schema as it is now where the change log (``logged``) has a column it lacks or a
    wider type: a fold that started with the schema from before a batch added columns (one owed while another
    fold ran, or the maintenance job's beside the replica) must apply their values, not drop them and then retire
    the changes that held them. A column is added to the table before its change log, so the table has it."""
    kept = {f.name: f.dataType for f in schema.kept.fields}
    columns = user_columns(logged).fields
    if all(kept.get(f.name) == f.dataType for f in columns):
        return schema
    current = current_schema(spark, schema.table)
    lacking = [f.name for f in columns if f.name not in current.kept.fieldNames()]
    assert not lacking, f"{schema.table.target.describe()} lacks columns of its change log: {lacking}"
    return current


#: How often :func:`retire` tries again when a batch appended to the change log while it ran.
RETIRE_ATTEMPTS = 5


def retire(spark: SparkSession, table: TableConfig, marks: dict[str, int]) -> None:
    """Delete the changes a fold applied from the table's change log: ``marks`` holds, per generation, the last
    batch whose changes it applied. Repeating it is harmless.

    Delta isolates every commit serializably: a DELETE by other than partition columns fails when a batch
    appended to the table while it ran, though no appended change is one it deletes. It is tried again then, on
    the new version.
    """
    for attempt in range(1, RETIRE_ATTEMPTS + 1):
        try:
            with typed_conflicts():
                retire_changes(spark, changes_target(table), marks)
            return
        except ConcurrentAppendError:
            if attempt == RETIRE_ATTEMPTS:
                raise
            logger.info("retiring folded changes of %s: a batch appended meanwhile, again (%d)", table.name, attempt)


def pending_versions(
    spark: SparkSession, table: TableConfig, keys_df: DataFrame, generation: str, batch_id: int
) -> DataFrame:
    """Every known version of the keys in ``keys_df`` (base row, pending changes, retained deletes), as
    ``keys + _src_partition, _src_offset, _src_seq``: what a Kafka tombstone's seq is inherited from.

    The changes of batch ``batch_id`` of ``generation`` itself are left out, so that its re-run decides the same.
    The change log is read at its version now, before the base and the retained deletes are: a fold beside the
    batch writes those two before it retires changes, so every change is in one of the three reads.
    """
    keys = list(table.keys)
    columns = version_columns(table.keys)
    own = (F.col("_generation") == generation) & (F.col("_batch_id") == batch_id)
    log = changes_target(table)
    frames = [read_table(spark, log, latest_version(spark, log)).where(~own).select(*columns)]
    sources: list[Target] = [table.target, tombstone_target(table)]
    frames += [read_table(spark, target).select(*columns) for target in sources]
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionByName(frame)
    return union.join(F.broadcast(keys_df.select(*keys).distinct()), keys, "left_semi")
