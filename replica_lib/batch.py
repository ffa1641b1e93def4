"""The foreachBatch handler: decode -> order (and dedup) -> MERGE, exactly once per batch.

Per table, the batch's winning deletes are appended to the tombstone table and the replica table is merged. If
a crash lands between the two commits, Spark re-runs the batch: the write already committed is skipped (the MERGE
by Delta, for the same ``txnAppId`` and batch id; the tombstones by the handler, which finds them when it reads the
tombstone table at its first batch), and the current state read for ordering ignores the tombstones that this very
batch wrote, so the re-run decides exactly what the first run decided. The tombstones are appended first, never
beside the MERGE: the MERGE's idempotence is carried by the session's Delta write confs (``merge.idempotent``), which
a write beside it in the same session would read as its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field, replace
from functools import reduce
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.util import inheritable_thread_target

from replica_lib import decode, evolution, logical, quarantine
from replica_lib.config import ReplicaConfig, TableConfig, Target
from replica_lib.errors import ConcurrentCommitError, ReplicaError, jvm_causes, jvm_condition
from replica_lib.layout import RANGE_TYPES, fold, pending_versions
from replica_lib.merge import (
    BROADCAST_ROWS,
    Applied,
    Commit,
    KeyRange,
    append_changes,
    append_quarantine,
    append_rows,
    append_tombstones,
    compact_files,
    merge_rows,
    typed_conflicts,
)
from replica_lib.monitor import GroupOffsets
from replica_lib.ordering import current_versions, held, latest_per_key, log_order, one_per_key, unapplied
from replica_lib.progress import (
    Offsets,
    batch_end_offsets,
    checkpoint_generation,
    last_batch,
    offsets_json,
    path_exists,
)
from replica_lib.recovery import check_partitions, log_order_kept
from replica_lib.session import FOLD_POOL, replica_session
from replica_lib.target import (
    Evolution,
    TableSchema,
    changes_target,
    evolve_table,
    is_empty,
    read_table,
    replica_targets,
    tombstone_target,
    version_columns,
    with_new_fields,
)

logger = logging.getLogger(__name__)

#: How often a batch runs when executors holding its materialized rows keep being lost.
BATCH_ATTEMPTS = 3
#: Spark's error condition for a local checkpoint's block lost with its executor.
_LOST_CHECKPOINT_BLOCK = "CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND"

#: How often a batch MERGEs a table when a concurrent commit (an operator's OPTIMIZE) keeps winning the race.
MERGE_ATTEMPTS = 5

#: The named points of a batch at which :attr:`BatchHooks.at` is called, in the order a batch passes them.
HOOK_POINTS = ("before_batch", "after_quarantine", "after_tombstones", "after_commit", "after_compaction")
#: With a merge-on-read table, a fold that a batch starts passes ``replica_lib.layout.FOLD_POINTS`` (with that
#: batch's id) in the fold's own thread, beside the batches that follow (see :class:`_Folds`); the compaction of
#: its tables, which runs in that thread too, passes this point once it has committed.
FOLD_COMPACTION_POINT = "after_fold_compaction"
#: The batch id a fold at a run's start (``BatchHandler.fold_pending``) passes to the hooks: it follows no batch.
AT_START = -1


class StopRequested(Exception):
    """Raised by the handler before any write once a stop was requested: the batch runs on the next start."""


@dataclass
class BatchStats:
    """What one micro-batch did, for the per-batch log line and for tests."""

    batch_id: int
    records: int = 0
    upserts: int = 0
    deletes: int = 0
    quarantined: int = 0
    late: int = 0  # keys whose last change in this batch's log has a lower seq than an earlier one (late changes)
    late_tables: dict[str, int] = field(default_factory=dict)  # ``late`` by table, for the tables that had any
    #: Records that carried a field their table does not keep, by ``table.field`` (see replica_lib.evolution).
    unknown_fields: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage of the batch, in order

    def _unknown(self) -> str:
        return ", ".join(f"{name} in {n} records" for name, n in sorted(self.unknown_fields.items()))

    def line(self, replica: str) -> str:
        ends = " ".join(
            f"{t}:{','.join(f'{p}={o}' for p, o in sorted(parts.items()))}" for t, parts in sorted(self.offsets.items())
        )
        return (
            f"replica {replica} batch {self.batch_id}: {self.records} records in, {self.upserts} upserts, "
            f"{self.deletes} deletes, {self.quarantined} quarantined, "
            f"{f'{self.late} late changes (a lower seq after a higher one), ' if self.late else ''}"
            f"{f'fields not kept: {self._unknown()}, ' if self.unknown_fields else ''}"
            f"{self.seconds:.2f}s ({', '.join(f'{k} {v:.2f}s' for k, v in self.stages.items()) or '-'}), "
            f"offsets {ends or '-'}"
        )


@dataclass(frozen=True)
class BatchHooks:
    """Optional callbacks into the handler, for tests, benchmarks and the fault harness; a replica sets none.

    ``at(point, batch_id)`` is called at each of :data:`HOOK_POINTS`; ``after_batch(stats)`` after each batch
    with records.
    """

    at: Callable[[str, int], None] | None = None
    after_batch: Callable[[BatchStats], None] | None = None


def app_id(replica: str, table: str, generation: str) -> str:
    """Delta ``txnAppId`` for one table of one replica under one checkpoint generation."""
    return f"replica:{replica}:{table}:{generation}"


def quarantine_rows(rejected_df: DataFrame, replica: str, batch_id: int) -> DataFrame:
    """Rejected envelope or table rows in the quarantine table's shape."""
    return rejected_df.select(
        F.lit(replica).alias("replica"),
        F.lit(batch_id).cast("long").alias("batch_id"),
        F.col("_topic").alias("topic"),
        F.col("_partition").alias("partition"),
        F.col("_offset").alias("offset"),
        F.col("_kafka_ts").alias("kafka_timestamp"),
        F.col("_key").alias("key"),
        F.col("_value").alias("value"),
        F.col("_table").alias("table"),
        F.col("_error").alias("reason"),
        F.current_timestamp().alias("quarantined_at"),
        F.col("_held_key").alias("held_key"),
    )


@dataclass(frozen=True)
class _Batch:
    """One micro-batch being handled: its id, session, stats, stage timer and the metadata of its commits."""

    batch_id: int
    spark: SparkSession
    generation: str
    stats: BatchStats
    stage: _Stages
    metadata: dict[str, Any]


@dataclass(frozen=True)
class _Records:
    """A batch's records as the handler is given them: raw, as the Kafka source reads them, or decoded by the
    replica's query itself (:func:`replica_lib.decode.stream_changes`), with the table schema it decoded them by."""

    df: DataFrame
    decoded_by: TableSchema | None = None


@dataclass(frozen=True)
class _Decoded:
    """The batch's changes per table (materialized), and what the decode counted of them."""

    records: int  # every record of the batch, valid or rejected
    rejected: int
    changes: dict[str, DataFrame]
    summaries: dict[str, _Summary]
    ranked: frozenset[str]  # tables whose changes are one per key already (see ordering.one_per_key)


class BatchHandler:
    """The ``foreachBatch`` function of one replica: decode, quarantine, then per table order and write, compact.

    It holds no Spark state between batches except what it can rebuild (the checkpoint generation, which tables
    are known to hold data, the retained deletes), and owns the threads that read the retained deletes beside the
    query's start.
    """

    def __init__(
        self,
        cfg: ReplicaConfig,
        schemas: dict[str, TableSchema],
        hooks: BatchHooks | None = None,
        stop_requested: Callable[[], bool] | None = None,
        report: Callable[[BatchStats], None] | None = None,
        monitored: bool = True,
        replay: bool = False,
        topic_ids: Mapping[str, str] | None = None,
        quarantine_id: str | None = None,
    ) -> None:
        self.cfg, self.schemas = cfg, schemas
        #: Recorded with the offsets of every commit, so that a topic created again under its name is told apart.
        self.topic_ids = dict(topic_ids or {})
        #: Recorded too: the quarantine table holds what the tables' rows wait for (``replica_lib.recovery``).
        self.quarantine_id = quarantine_id
        #: Applying quarantined records again (``replica_lib.replay``): the records rejected again stay where they
        #: are (in :attr:`rejected_again`), and the commits record no offsets.
        self.replay = replay
        self.rejected_again: DataFrame | None = None
        self.report = report  # takes every finished batch's figures (the per-batch metrics)
        self.hooks = hooks or BatchHooks()
        self.stop_requested = stop_requested
        #: The batch refused after a stop request (the query then fails with :class:`StopRequested`), or None.
        self.refused: int | None = None
        #: What the last failed batch raised, as it raised it: the query passes on only its text.
        self.failure: BaseException | None = None
        #: The last batch this handler finished, or None.
        self.last_batch: int | None = None
        self._generation: str | None = None
        self._offsets: Offsets | None = None  # the end offsets of the last batch this run finished
        self._filled: set[str] = set()  # tables known to hold data: they never need the emptiness check again
        self._streamed: TableSchema | None = None  # the schema the query decodes its records by (see stream)
        self._stale_warned = False
        self._retained = _Retained()
        self._logged = _Logged(cfg.name)
        self._held = _Held()
        self._beside = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"replica-{cfg.name}-beside")
        self._folds = _Folds(cfg.name)
        # Applied offsets for Kafka tooling, committed off the batch's path (not by a rebuild: the group is the
        # live replica's).
        self._group_offsets = GroupOffsets(cfg) if monitored else None

    def stream(self, raw_df: DataFrame) -> DataFrame:
        """What the replica's query runs on, from its raw records: for a replica of one table, the records decoded
        in the query's own plan (``decode.stream_changes``: Spark analyses the decode once, not at every batch),
        which the handler then takes as decoded; for one of several tables, the raw records."""
        decoded = decode.stream_changes(raw_df, self.cfg, self.schemas)
        if decoded is None:
            return raw_df
        self._streamed = self.schemas[self.cfg.tables[0].name]
        return decoded

    def prefetch(self, spark: SparkSession) -> None:
        """Start reading what the first batch needs of the copy-on-write tables (their retained deletes), on the
        session the batches will run on: beside the query's start and the first decode instead of after them."""
        if not self.replay:
            tables = [self.schemas[t.name] for t in self.cfg.tables if not t.merge_on_read]
            self._retained.prefetch(spark, tables, self._beside)

    def close(self) -> None:
        """Release the handler's threads (after its query stopped), once a fold in flight ended and the last
        applied offsets are committed."""
        self._retained.cancel()
        self._folds.close()
        self._beside.shutdown(wait=True)
        if self._group_offsets is not None:
            self._group_offsets.close()

    def fold_pending(self, spark: SparkSession) -> None:
        """Start a fold of the merge-on-read tables that the replica folds, beside the query's start: what a run
        left pending (a fold that failed, such as one refused by ``log_order_kept``) is folded, or refused, even
        when no record comes to start a batch. A fold of an empty change log is two small Spark jobs."""
        due = [self.schemas[t.name] for t in self.cfg.tables if t.merge_on_read and t.fold_every_batches]
        if due:
            self._folds.start(spark, due, Compaction(), AT_START, self.hooks.at)

    def fold_failed(self) -> bool:
        """Whether the last fold beside the batches ended with a failure (which :meth:`wait_for_folds` raises)."""
        return self._folds.failed()

    def wait_for_folds(self) -> None:
        """Wait for the fold in flight, if any; raise what it raised (other than losing a race to another fold)."""
        with log_order_kept(self.cfg):
            self._folds.finish()

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        if self.stop_requested is not None and self.stop_requested():
            self.refused = batch_id
            raise StopRequested(f"replica {self.cfg.name}: stop requested, batch {batch_id} runs on the next start")
        spark = batch_df.sparkSession
        if self._generation is None:
            self._generation = checkpoint_generation(spark, self.cfg.checkpoint)
        try:
            offsets = batch_end_offsets(spark, self.cfg.checkpoint, batch_id)
            self._check_partitions(spark, batch_id, offsets)
            records = _Records(batch_df, self._streamed)
            self._run(records, batch_id, offsets)
            self._offsets = offsets
        except (Py4JJavaError, PySparkException, ReplicaError) as exc:
            self.failure = exc
            raise

    def _check_partitions(self, spark: SparkSession, batch_id: int, offsets: Offsets) -> None:
        """Refuse a batch whose topics gained partitions since the batch before (``recovery.check_partitions``);
        that batch's offsets are read from the checkpoint for the first batch a run makes."""
        if self._offsets is None and batch_id > 0:
            previous = f"{self.cfg.checkpoint.rstrip('/')}/offsets/{batch_id - 1}"
            if path_exists(spark, previous):
                self._offsets = batch_end_offsets(spark, self.cfg.checkpoint, batch_id - 1)
        if self._offsets is not None:
            check_partitions(self.cfg, self._offsets, offsets, f"seen at batch {batch_id}")

    def apply(self, batch_df: DataFrame, batch_id: int, offsets: Offsets, generation: str) -> BatchStats:
        """Apply a static frame of records as batch ``batch_id`` of ``generation``, ending at ``offsets``.

        The bulk path of a rebuild: one frame for a whole range of the log, with the streaming batch's decoding,
        quarantine, ordering and idempotent writes (a re-run with the same generation and batch id writes nothing
        already committed). Returns once a fold it started has ended.
        """
        self._generation = generation
        stats = self._run(_Records(batch_df), batch_id, offsets)
        with log_order_kept(self.cfg):
            self._folds.finish()  # the caller reads the tables next
        return stats

    def _run(self, records: _Records, batch_id: int, offsets: Offsets) -> BatchStats:
        """Run the batch; again from its records if an executor holding its materialized rows was lost.

        The stages materialize their rows on the executors (local checkpoints: no second read of the log, and
        a plan that stays short), and so do the retained deletes kept between batches; an executor lost with
        them fails the batch, which a new attempt with the same batch id repeats exactly as a restart would (the
        retained deletes read again from their table, every write idempotent), on the executors left.
        """
        attempt = 1
        while True:
            try:
                with log_order_kept(self.cfg):
                    return self._run_once(records, batch_id, offsets)
            except (Py4JJavaError, PySparkException) as exc:
                if attempt >= BATCH_ATTEMPTS or not _lost_materialized_rows(exc):
                    raise
                attempt += 1
                self._retained = _Retained()  # its rows were materialized on the executors too: read them again
                logger.warning(
                    "replica %s batch %d: an executor holding the batch's materialized rows was lost; running the "
                    "batch again from its records (attempt %d of %d)",
                    self.cfg.name,
                    batch_id,
                    attempt,
                    BATCH_ATTEMPTS,
                )

    def _run_once(self, records: _Records, batch_id: int, offsets: Offsets) -> BatchStats:
        self._folds.check()  # a fold that failed fails the next batch, before it writes anything
        batch = self._begin(records.df, batch_id, offsets)
        self._at("before_batch", batch)
        decoded = self._decode(batch, records)
        if decoded.records:
            _size_for(batch.spark, decoded.records)
            self._quarantine(batch, decoded)
            self._at("after_quarantine", batch)
            for table in self.cfg.tables:
                self._apply(batch, decoded, table)
            self._at("after_commit", batch)
            self._fold(batch)
            self._compact(batch)
        batch.stats.seconds = time.monotonic() - batch.stage.started
        logger.info(batch.stats.line(self.cfg.name))
        if self._group_offsets is not None:
            self._group_offsets.publish(batch.stats.offsets)
        self.last_batch = batch_id
        if self.report is not None:
            self.report(batch.stats)
        if decoded.records and self.hooks.after_batch is not None:
            self.hooks.after_batch(batch.stats)
        return batch.stats

    # ------------------------------------------------------------------------------------------------ stages
    def _begin(self, batch_df: DataFrame, batch_id: int, offsets: Offsets) -> _Batch:
        spark = batch_df.sparkSession
        assert self._generation is not None
        stats = BatchStats(batch_id=batch_id, offsets={t: dict(parts) for t, parts in offsets.items()})
        metadata: dict[str, Any] = {"replica": self.cfg.name, "batch_id": batch_id, "generation": self._generation}
        if self.replay:
            metadata["replay"] = True  # no offsets: such a commit says nothing of how far the log is applied
        else:
            metadata["offsets"] = offsets_json(stats.offsets)
            if self.topic_ids:
                metadata["topic_ids"] = self.topic_ids
            metadata["sequence_by"] = {t.name: t.sequence_by for t in self.cfg.tables}
            if self.quarantine_id:
                metadata["quarantine_id"] = self.quarantine_id
        stage = _Stages(spark, stats, f"replica {self.cfg.name} batch {batch_id}")
        return _Batch(batch_id, spark, self._generation, stats, stage, metadata)

    def _decode(self, batch: _Batch, records: _Records) -> _Decoded:
        """Decode the batch into each table's changes, read from Kafka once and counted in the same job.

        Each table's changes are checkpointed locally: that truncates the plan, so the later stages (and Delta's
        MERGE, which plans its source several times) do not analyse the decoding expressions again.
        """
        ranked = {t.name for t in self.cfg.tables}
        with batch.stage("decode"):
            env_df = None
            if self._decoded(records):
                first = {self.cfg.tables[0].name: self._table_changes(records, 0, keep_raw=False)}
            else:
                env_df = decode.envelopes(self._raw(records), self.cfg, self.schemas)
                if len(self.cfg.tables) > 1:
                    env_df = env_df.persist()  # each table's changes are read from it
                # The first table's changes also hold the envelopes routed to no table (rejected).
                first = {
                    t.name: decode.table_changes(env_df, self.schemas[t.name], i == 0, len(self.cfg.tables) == 1)
                    for i, t in enumerate(self.cfg.tables)
                }
            changes, observed = {}, {}
            for name, changes_df in first.items():
                changes[name], observation, winners = _observed(changes_df, self.schemas[name], ranked=True)
                observed[name] = (observation, winners)
            summaries = {name: _summary(o, w, self.schemas[name]) for name, (o, w) in observed.items()}
            if env_df is not None:
                env_df.unpersist()
            if self._add_columns(batch, summaries):  # the batch's records name fields new to a table
                return self._decode(batch, records)
            self._count_new_fields(batch, records, summaries)
            earlier = {
                t.name: self._held.of(batch.spark, self.cfg, self.schemas[t.name])
                for t in self.cfg.tables
                if t.holds_keys and not self.replay
            }
            for i, t in enumerate(self.cfg.tables):
                # A Kafka tombstone on a sequenced table inherits the seq of the changes before it and of the
                # table's row, and a quarantined record holds back only its key's later changes (quarantined with
                # their bytes): the ranking needs every change, so this table's are decoded again, unranked.
                holding = t.holds_keys and (summaries[t.name].rejected > 0 or earlier.get(t.name) is not None)
                if (t.sequence_by is not None and summaries[t.name].tombstones) or holding:
                    changes_df = self._table_changes(records, i, keep_raw=holding)
                    changes[t.name] = changes_df.drop(decode.ROW, logical.CONNECT_FIELDS).localCheckpoint()
                    ranked.discard(t.name)
            self._hold(batch, changes, summaries, ranked, earlier)
        count = sum(s.records for s in summaries.values())
        rejected = sum(s.rejected for s in summaries.values())
        batch.stats.records = count
        batch.stats.late_tables = {name: s.late for name, s in summaries.items() if s.late}
        batch.stats.late = sum(batch.stats.late_tables.values())
        if batch.stats.late:
            late = ", ".join(f"{name} {n}" for name, n in batch.stats.late_tables.items())
            logger.warning(
                "replica %s batch %d: late changes (a key's last change in the log has a lower seq than an earlier "
                "one; a rebuild from a compacted topic would keep the lower one): %s",
                self.cfg.name,
                batch.batch_id,
                late,
            )
        return _Decoded(count, rejected, changes, summaries, frozenset(ranked))

    def _add_columns(self, batch: _Batch, summaries: dict[str, _Summary]) -> bool:
        """Add the new fields of the batch's records to their ``add_columns`` tables; whether any was added."""
        added = False
        for table in self.cfg.tables:
            new = summaries[table.name].new_fields
            if not (new.addable or new.widened):
                continue
            self._folds.finish()  # a fold writes with the schema it started with
            schema = with_new_fields(self.schemas[table.name], new.addable, new.widened)
            why = f"from the records of batch {batch.batch_id}"
            evolve_table(batch.spark, schema, Evolution(new.addable, new.widened), self.cfg.name, why)
            self.schemas[table.name] = schema
            added = True
        return added

    def _count_new_fields(self, batch: _Batch, records: _Records, summaries: dict[str, _Summary]) -> None:
        """Count the records that carry fields their table does not keep (a job, only for a batch with some)."""
        for i, table in enumerate(self.cfg.tables):
            counted = summaries[table.name].new_fields.counted
            if not counted:
                continue
            changes_df = self._table_changes(records, i, keep_raw=False)
            found = evolution.counts(changes_df, [name for name, _ in counted])
            for name, why in counted:
                batch.stats.unknown_fields[f"{table.name}.{name}"] = found[name]
                logger.warning(
                    "replica %s batch %d: %d records of table %s carry field %s, which the table does not keep (%s)",
                    self.cfg.name,
                    batch.batch_id,
                    found[name],
                    table.name,
                    name,
                    why,
                )

    def _hold(
        self,
        batch: _Batch,
        changes: dict[str, DataFrame],
        summaries: dict[str, _Summary],
        ranked: set[str],
        earlier_keys: dict[str, DataFrame | None],
    ) -> None:
        """Mark rejected the changes that a quarantined record of their key holds back (``on_poison = "hold_key"``):
        one of this batch, or an unresolved one of an earlier batch. Nothing to do, and no job, for a table with
        neither."""
        for table in self.cfg.tables:
            summary = summaries[table.name]
            if not table.holds_keys:
                continue
            schema = self.schemas[table.name]
            earlier = earlier_keys.get(table.name)
            if not summary.rejected and earlier is None:
                continue
            held_df = held(changes[table.name], table.keys, table.name, earlier, summary.rejected <= BROADCAST_ROWS)
            changes[table.name], observation, _ = _observed(held_df, schema, ranked=False, fields=False)
            counted = _summary(observation, None, schema)
            deletes = counted.deletes
            summaries[table.name] = replace(
                counted,
                ranked_upserts=counted.valid - deletes if table.name in ranked else 0,
                ranked_deletes=deletes if table.name in ranked else 0,
                records=summary.records,
                late=summary.late,
                new_fields=summary.new_fields,
            )
            if counted.rejected > summary.rejected:
                logger.warning(
                    "replica %s batch %d: %d changes of table %s held behind quarantined records of their keys",
                    self.cfg.name,
                    batch.batch_id,
                    counted.rejected - summary.rejected,
                    table.name,
                )
            self._held.forget(table.name)  # what it holds may have changed: read it again next batch

    def _quarantine(self, batch: _Batch, decoded: _Decoded) -> None:
        with batch.stage("quarantine"):
            batch.stats.quarantined = decoded.rejected
            if not decoded.rejected:
                return
            rejected_df = _union(
                [
                    decode.rejected(decoded.changes[t.name]).withColumn("_held_key", _held_key(t))
                    for t in self.cfg.tables
                ]
            ).dropDuplicates(_COORDINATES)
            if self.replay:  # they are in the quarantine already, unresolved
                self.rejected_again = rejected_df.localCheckpoint()
                return
            for t in self.cfg.tables:
                self._held.forget(t.name)
            rows_df = quarantine_rows(rejected_df, self.cfg.name, batch.batch_id)
            commit = Commit(app_id(self.cfg.name, "_quarantine", batch.generation), batch.batch_id, batch.metadata)
            append_quarantine(self.cfg.quarantine, rows_df, commit)

    def _apply(self, batch: _Batch, decoded: _Decoded, table: TableConfig) -> None:
        """Order one table's changes against what it holds, then write the winners."""
        if table.merge_on_read:
            self._log(batch, decoded, table)
            return
        schema, summary = self.schemas[table.name], decoded.summaries[table.name]
        table_app = app_id(self.cfg.name, table.name, batch.generation)
        with batch.stage(f"{table.name}: order"):
            rows_empty = self._empty(batch.spark, table.target)
            deletes_df = self._retained.of(batch.spark, schema, table_app, batch.batch_id)
            changes_df = decoded.changes[table.name]
            ranked = table.name in decoded.ranked
            small, none = self._retained.few(table.name), self._retained.none(table.name)
            winners = _winners(batch.spark, changes_df, summary, schema, deletes_df, rows_empty, ranked, small, none)
        if winners is None:
            return
        applied = self._write(batch, table, schema, winners, rows_empty)
        if winners.deletes:
            self._retained.add(table.name, winners, schema)
        batch.stats.upserts += applied.upserted
        batch.stats.deletes += winners.count_deletes() if rows_empty else applied.deleted

    def _log(self, batch: _Batch, decoded: _Decoded, table: TableConfig) -> None:
        """Append a merge-on-read table's winners to its change log: nothing of the table is read.

        Ranked in the decode's job, the winners are appended as they are; the state (:mod:`replica_lib.layout`)
        and the fold rank them against what the table holds. Only a sequenced table's Kafka tombstones, which
        inherit the seq of the state they delete, read the versions of their own keys first.
        """
        schema, summary = self.schemas[table.name], decoded.summaries[table.name]
        if not summary.valid:
            return
        keys = list(table.keys)
        changes_df = decode.valid(decoded.changes[table.name])
        if table.name in decoded.ranked:
            winners_df, upserts, deletes = changes_df, summary.ranked_upserts, summary.ranked_deletes
        else:
            with batch.stage(f"{table.name}: order"):
                tombstone_keys = changes_df.where(F.col("_tombstone"))
                states = pending_versions(batch.spark, table, tombstone_keys, batch.generation, batch.batch_id)
                winners_df = latest_per_key(changes_df, keys, current_versions(keys, states), log_order(table))
                winners_df = winners_df.localCheckpoint()
                counts = {str(op): int(n) for op, n in winners_df.groupBy("_op").count().collect()}
                upserts, deletes = int(counts.get("upsert", 0)), int(counts.get("delete", 0))
        commit = Commit(app_id(self.cfg.name, table.name, batch.generation), batch.batch_id, batch.metadata)
        with batch.stage(f"{table.name}: log"), self._folds.retiring:  # not beside a fold's retirement
            if not self._logged.committed(batch.spark, table, batch.generation, batch.batch_id):
                try:
                    append_changes(changes_target(table), winners_df, schema, commit, batch.generation, checked=True)
                except BaseException:
                    self._logged.forget(table.name)  # the commit may have landed: read the log's history again
                    raise
                self._logged.appended(table.name, batch.batch_id)
        batch.stats.upserts += upserts
        batch.stats.deletes += deletes

    def _fold(self, batch: _Batch) -> None:
        """Start a fold of the merge-on-read tables whose turn it is (by batch id, as the compaction), and their
        compaction at its turn, beside the batches that follow; a turn that comes while a fold is still running is
        taken by the first batch after it."""
        due = [
            t
            for t in self.cfg.tables
            if t.merge_on_read and t.fold_every_batches and not (batch.batch_id + 1) % t.fold_every_batches
        ]
        schemas = [self.schemas[t.name] for t in due]
        compact = _fold_targets(self.cfg) if self._compaction_due(batch) else ()
        compaction = Compaction(compact, self.cfg.compaction.small_file_mb << 20)
        self._folds.start(batch.spark, schemas, compaction, batch.batch_id, self.hooks.at)

    def _write(
        self, batch: _Batch, table: TableConfig, schema: TableSchema, winners: _Winners, rows_empty: bool
    ) -> Applied:
        """Append the winning deletes to the tombstone log, then merge (or append) the winners into the table.

        One after the other: the tombstone append is made without Delta's idempotence options (``checked``), so
        Delta would take the MERGE's from the session's confs if it ran while the MERGE holds them.
        """
        table_app = app_id(self.cfg.name, table.name, batch.generation)
        tombstone_commit = Commit(f"{table_app}:tombstones", batch.batch_id, batch.metadata)
        self._tombstones(batch, table, schema, winners, tombstone_commit)
        commit = Commit(table_app, batch.batch_id, batch.metadata)
        with batch.stage(f"{table.name}: merge"):
            if rows_empty:
                return append_rows(table.target, winners.df, schema, commit, winners.upserts())
            return self._merge(batch, table, schema, winners, commit)

    def _merge(
        self, batch: _Batch, table: TableConfig, schema: TableSchema, winners: _Winners, commit: Commit
    ) -> Applied:
        """MERGE the winners, again on the table's new version when a concurrent commit won (an operator's OPTIMIZE
        removed files the MERGE read): the MERGE did not commit, and its write is idempotent."""
        attempt = 1
        while True:
            try:
                with typed_conflicts():
                    return merge_rows(
                        batch.spark, table.target, winners.df, schema, commit, winners.rows, winners.key_range
                    )
            except ConcurrentCommitError as conflict:
                if attempt >= MERGE_ATTEMPTS:
                    raise
                attempt += 1
                logger.warning(
                    "%s: a concurrent commit on %s won (%s); merging again on its new version (attempt %d of %d)",
                    batch.stage.label,
                    table.target.describe(),
                    type(conflict).__name__,
                    attempt,
                    MERGE_ATTEMPTS,
                )

    def _tombstones(
        self, batch: _Batch, table: TableConfig, schema: TableSchema, winners: _Winners, commit: Commit
    ) -> None:
        """Append the batch's winning deletes to the table's tombstone log (an append: see :func:`_winners`), unless
        a run of this batch before a restart appended them already (see :meth:`_Retained.committed`)."""
        with batch.stage(f"{table.name}: tombstones"):
            if winners.deletes and not self._retained.committed(table.name, batch.batch_id):
                try:
                    append_tombstones(tombstone_target(table), winners.df, schema, commit, checked=True)
                except BaseException:
                    self._retained.forget(table.name)  # the commit may have landed: read the table again
                    raise
                self._retained.appended(table.name, batch.batch_id)
        self._at("after_tombstones", batch)

    def _compaction_due(self, batch: _Batch) -> bool:
        """By batch id, so a replica run in short ``--available-now`` runs compacts as often as a long-running one."""
        every = self.cfg.compaction.every_batches
        return bool(every) and not (batch.batch_id + 1) % every

    def _compact(self, batch: _Batch) -> None:
        """Pack the small files of the tables the batches write, between two batches: no MERGE of its own can
        conflict. A merge-on-read table's are packed beside the batches, in its folds' thread (:meth:`_fold`): the
        folds write them, and a batch that waited for a fold and its compaction stalled the replica for seconds."""
        if not self._compaction_due(batch):
            return
        beside = _fold_targets(self.cfg)
        with batch.stage("compact"):
            targets = [t for t in replica_targets(self.cfg, metrics=False) if t not in beside]
            done = _compact_all(batch.spark, targets, self.cfg.compaction.small_file_mb << 20)
            logger.info("%s: compacted %s", batch.stage.label, done)
        self._at("after_compaction", batch)

    # ------------------------------------------------------------------------------------------------ helpers
    def _decoded(self, records: _Records) -> bool:
        """Whether the batch's records come decoded by the table's current schema: not after the handler added
        columns to it (the query's plan keeps the schema it started with; a restart decodes by the new one)."""
        if records.decoded_by is None:
            return False
        if records.decoded_by == self.schemas[self.cfg.tables[0].name]:
            return True
        if not self._stale_warned:
            self._stale_warned = True
            logger.warning(
                "replica %s: table %s has new columns since the replica started; its batches decode each record "
                "again, by the new schema, until the replica is restarted",
                self.cfg.name,
                self.cfg.tables[0].name,
            )
        return False

    def _raw(self, records: _Records) -> DataFrame:
        """The batch's records as the Kafka source reads them."""
        return records.df if records.decoded_by is None else decode.records(records.df)

    def _table_changes(self, records: _Records, index: int, keep_raw: bool) -> DataFrame:
        """The changes of the ``index``-th table, not ranked; ``keep_raw``: every change keeps its raw record."""
        if self._decoded(records):
            return records.df if keep_raw else decode.without_valid_raw(records.df)
        env_df = decode.envelopes(self._raw(records), self.cfg, self.schemas)
        table = self.cfg.tables[index]
        alone = len(self.cfg.tables) == 1
        return decode.table_changes(env_df, self.schemas[table.name], index == 0, alone, keep_raw=keep_raw)

    def _at(self, point: str, batch: _Batch) -> None:
        if self.hooks.at is not None:
            self.hooks.at(point, batch.batch_id)

    def _empty(self, spark: SparkSession, target: Target) -> bool:
        if target.describe() in self._filled:
            return False
        if is_empty(spark, target):
            return True
        self._filled.add(target.describe())
        return False


#: A fold's shuffles run in this many tasks per core (a batch's: at most one per core, see :func:`_size_for`).
FOLD_TASKS_PER_CORE = 4


class _Folds:
    """The folds of a replica's merge-on-read tables, beside its batches: one at a time, in a thread and a session
    of their own, in the scheduler pool that runs tasks only on cores the batches leave idle (``FOLD_POOL``).

    A fold reads the change log as it is when it starts, MERGEs into the base and appends retained deletes (which
    no batch writes): the batches go on appending meanwhile, and readers see the state throughout (see
    :mod:`replica_lib.layout`). A change log created before it was partitioned by batch is retired holding
    :attr:`retiring`, which the batches' appends take too: Delta refuses a DELETE of its rows when a batch appended
    meanwhile; a partitioned one's retirement takes no lock. A fold is a few seconds of Spark jobs, as long as
    several small batches: run inside a batch, it set the replica's freshness. What a fold raises (other than
    losing a race to another fold) fails the next batch, before it writes (``stream.run_replica`` stops at once).
    The compaction of these tables runs here too, after the fold of its turn: no fold can then rewrite the files it
    packs, and no batch waits for it.
    """

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{replica}-fold")
        self._running: futures.Future[None] | None = None
        self._owed: dict[str, TableSchema] = {}  # tables whose turn came while a fold ran
        self._compaction_owed = Compaction()  # a compaction whose turn came while a fold ran
        self._session: SparkSession | None = None
        #: Held by a fold's retirement from an unpartitioned change log and by each append of a batch to one.
        self.retiring = threading.Lock()

    def start(
        self,
        spark: SparkSession,
        due: list[TableSchema],
        compaction: Compaction,
        batch_id: int,
        at: Callable[[str, int], None] | None,
    ) -> None:
        """Fold ``due`` (and the tables owed a fold), then run ``compaction`` (or the one owed) after batch
        ``batch_id``, unless a fold is still running."""
        self._owed.update((schema.table.name, schema) for schema in due)
        if compaction.targets:
            self._compaction_owed = compaction
        if not (self._owed or self._compaction_owed.targets) or (
            self._running is not None and not self._running.done()
        ):
            return
        self.check()
        schemas, self._owed = list(self._owed.values()), {}
        compaction, self._compaction_owed = self._compaction_owed, Compaction()
        session = self._session_for(spark)
        self._running = self._pool.submit(self._fold, session, schemas, compaction, batch_id, at)

    def _session_for(self, spark: SparkSession) -> SparkSession:
        if self._session is None:
            self._session = replica_session(spark)  # its Delta write confs must not reach the batches' commits
            # Short tasks: a batch's task waits for a core that a task of the fold holds (see FOLD_POOL).
            cores = max(1, spark.sparkContext.defaultParallelism)
            self._session.conf.set("spark.sql.shuffle.partitions", str(FOLD_TASKS_PER_CORE * cores))
            self._session.conf.set("spark.sql.adaptive.enabled", "false")
        return self._session

    def _fold(
        self,
        spark: SparkSession,
        schemas: list[TableSchema],
        compaction: Compaction,
        batch_id: int,
        at: Callable[[str, int], None] | None,
    ) -> None:
        for schema in schemas:
            name = schema.table.name
            after = "at the start" if batch_id == AT_START else f"started after batch {batch_id}"
            label = f"replica {self.replica} fold of {name} ({after})"
            started = time.monotonic()
            hook = None if at is None else functools.partial(_at, at, batch_id)
            try:
                with _fold_jobs(spark, label):
                    folded = fold(spark, self.replica, schema, hook, self.retiring)
            except ConcurrentCommitError as conflict:  # a fold of the maintenance job won: the next one goes on
                logger.warning("%s: lost to a concurrent commit: %s", label, conflict)
                continue
            except (Py4JJavaError, PySparkException) as exc:
                if not _lost_materialized_rows(exc):
                    raise
                logger.warning("%s: an executor holding its rows was lost; the next fold takes its changes", label)
                continue
            logger.info("%s: %s, in %.1fs", label, folded.line(name), time.monotonic() - started)
        if compaction.targets:
            self._compact(spark, compaction, batch_id, at)

    def _compact(
        self, spark: SparkSession, compaction: Compaction, batch_id: int, at: Callable[[str, int], None] | None
    ) -> None:
        label = f"replica {self.replica} compaction of the folded tables (its turn at batch {batch_id})"
        started = time.monotonic()
        with _fold_jobs(spark, label):
            done = _compact_all(spark, compaction.targets, compaction.small_file_bytes)
        logger.info("%s: compacted %s, in %.1fs", label, done, time.monotonic() - started)
        if at is not None:
            at(FOLD_COMPACTION_POINT, batch_id)

    def failed(self) -> bool:
        running = self._running
        return running is not None and running.done() and running.exception() is not None

    def check(self) -> None:
        """Raise what the last fold raised, once it has ended."""
        running = self._running
        if running is not None and running.done():
            self._running = None
            running.result()

    def finish(self) -> None:
        """Wait for the fold in flight; raise what it raised."""
        running = self._running
        if running is not None and not running.done():
            logger.info("replica %s: waiting for the fold in flight", self.replica)
            futures.wait([running])
        self.check()

    def close(self) -> None:
        """:meth:`finish`, with a failure logged (the batches are over), then release the thread."""
        try:
            self.finish()
        except Exception as exc:  # logged as one line, as the query's own failure would be
            logger.error("replica %s: the last fold failed (the next fold takes its changes): %s", self.replica, exc)
        self._pool.shutdown(wait=True)


def _at(at: Callable[[str, int], None], batch_id: int, point: str) -> None:
    at(point, batch_id)


@contextlib.contextmanager
def _fold_jobs(spark: SparkSession, label: str) -> Iterator[None]:
    """The Spark jobs of the folds' thread: named ``label`` (Spark UI, event log), in :data:`FOLD_POOL`, whose tasks
    run after the batches'."""
    spark.sparkContext.setJobDescription(label)
    spark.sparkContext.setLocalProperty("spark.scheduler.pool", FOLD_POOL)
    try:
        yield
    finally:
        spark.sparkContext.setJobDescription(None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Compaction:
    """The tables a compaction turn packs, and below what size a file counts as small."""

    targets: tuple[Target, ...] = ()
    small_file_bytes: int = 0


def _fold_targets(cfg: ReplicaConfig) -> tuple[Target, ...]:
    """The tables of the replica's merge-on-read tables that its folds write: each base, its retained deletes and
    its change log (which the folds retire; the batches only append to it)."""
    tables = [t for t in cfg.tables if t.merge_on_read]
    return tuple(target for t in tables for target in (t.target, tombstone_target(t), changes_target(t)))


def _compact_all(spark: SparkSession, targets: Sequence[Target], small_file_bytes: int) -> str:
    """Compact each of ``targets`` that holds files, as the log's checksum says: an OPTIMIZE of an empty table (a
    quarantine that nothing was sent to) takes 0.1 s warm, seconds as a process's first; what was packed, as a
    phrase for the log."""
    done = []
    for target in targets:
        if is_empty(spark, target):
            continue
        compacted = compact_files(spark, target, small_file_bytes)
        if compacted is not None and compacted.removed:
            done.append(f"{target.describe()} {compacted.removed} files into {compacted.added}")
    return ", ".join(done) or "nothing (no small files)"


class _Stages:
    """Times the stages of a batch into ``stats.stages`` and names their Spark jobs (Spark UI, event logs)."""

    def __init__(self, spark: SparkSession, stats: BatchStats, label: str) -> None:
        self.spark, self.stats, self.label = spark, stats, label
        self.started = time.monotonic()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        self.spark.sparkContext.setJobDescription(f"{self.label}: {name}")
        try:
            yield
        finally:
            self.spark.sparkContext.setJobDescription(None)  # type: ignore[arg-type]
            self.stats.stages[name] = self.stats.stages.get(name, 0.0) + time.monotonic() - started


_COORDINATES = ["_topic", "_partition", "_offset"]  # a record's place in the log: copies of a record share it


def _union(frames: list[DataFrame]) -> DataFrame:
    columns = [*_COORDINATES, "_kafka_ts", "_key", "_value", "_table", "_error", "_held_key"]
    result = frames[0].select(*columns)
    for frame in frames[1:]:
        result = result.unionByName(frame.select(*columns))
    return result


def _held_key(table: TableConfig) -> Column:
    """The key a rejected change of ``table`` holds (JSON of its typed key columns), where the table holds keys
    and the key was read; else null."""
    if not table.holds_keys:
        return F.lit(None).cast("string")
    known = reduce(lambda a, b: a & b, [F.col(f"`{k}`").isNotNull() for k in table.keys])
    key = F.to_json(F.struct(*[F.col(f"`{k}`") for k in table.keys]))
    return F.when((F.col("_table") == table.name) & known, key)


class _Held:
    """Whether each table's keys are held by unresolved quarantined records: read from the quarantine while some
    are (so a drop or replay releases them at the next batch), and not at all once none is, until a batch
    quarantines records of the table again."""

    def __init__(self) -> None:
        self.none: set[str] = set()  # tables known to hold no key

    def of(self, spark: SparkSession, cfg: ReplicaConfig, schema: TableSchema) -> DataFrame | None:
        name = schema.table.name
        if name in self.none:
            return None
        keys_df = quarantine.held_keys(spark, cfg, schema)
        if keys_df is not None:
            keys_df = keys_df.localCheckpoint()
            if keys_df.isEmpty():
                keys_df = None
        if keys_df is None:
            self.none.add(name)
        return keys_df

    def forget(self, name: str) -> None:
        self.none.discard(name)


@dataclass(frozen=True)
class _Winners:
    """A table's winning changes of one batch (materialized), with what the writes need to know about them."""

    df: DataFrame
    rows: int  # at most this many winners (the batch's valid changes)
    deletes: int  # at most this many winning deletes (the batch's valid deletes)
    key_range: KeyRange | None
    exact: bool = False  # ``rows`` and ``deletes`` are the winners' own counts (the ranking's, nothing taken out since)

    def count_deletes(self) -> int:
        """The winning deletes, counted (a Spark job, unless the counts are exact)."""
        if self.exact or not self.deletes:
            return self.deletes
        return self.df.where(F.col("_op") == "delete").count()

    def upserts(self) -> int | None:
        """The winning upserts, if counted already."""
        return self.rows - self.deletes if self.exact else None


#: Records per partition of a batch, rounded up: a batch of up to this many runs in one partition, as most of its
#: cost is per task; a larger one takes another core (a batch of 19,998 records ran its shuffles on one of two).
RECORDS_PER_PARTITION = 10_000


BATCH_SIZING = "spark.replica.batchSizing"


def _size_for(spark: SparkSession, records: int) -> None:
    """Size the batch's shuffles to its records (unless ``spark.replica.batchSizing=off``).

    A Spark job costs ~20 ms per task on top of its work; a micro-batch runs ~18 jobs, so a 1,000-record batch
    spread over 4 partitions spends most of its time scheduling tasks. Adaptive execution stays off: it plans
    more per job, and it coalesced a 200,000-record rebuild batch into one partition (decoding on one core:
    8.7 s instead of 3.4 s).
    """
    if spark.conf.get(BATCH_SIZING, "auto") == "off":
        return
    cores = max(1, spark.sparkContext.defaultParallelism)
    partitions = min(cores, max(1, -(-records // RECORDS_PER_PARTITION)))  # a partition per started 10,000
    spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    spark.conf.set("spark.sql.adaptive.enabled", "false")


@dataclass(frozen=True)
class _Summary:
    """One table's changes in a batch, counted while they are decoded: what the later stages decide on."""

    valid: int
    rejected: int
    deletes: int
    tombstones: int  # Kafka tombstones (null values) among the valid deletes
    keys: tuple[Column, Column]  # smallest and greatest first key column among the valid changes (literals)
    tombstone_keys: tuple[Column, Column]  # the same among the Kafka tombstones
    records: int  # every change, valid or rejected
    ranked_upserts: int = 0  # of a ranked table (see _observed): the winning upserts and deletes, one per key
    ranked_deletes: int = 0
    late: int = 0  # keys whose last change in the log has a lower seq than their winner (see one_per_key)
    new_fields: evolution.NewFields = field(default_factory=evolution.NewFields)  # fields the table lacks


def _observed(
    changes_df: DataFrame, schema: TableSchema, ranked: bool, fields: bool = True
) -> tuple[DataFrame, Observation, Observation | None]:
    """Materialize a table's changes (a local checkpoint) and count them in the same job (observations).

    ``ranked``: what is materialized is the greatest version per key (:func:`replica_lib.ordering.one_per_key`),
    ranked in the same job; the first observation still counts every change, the second the winners.

    The key bounds are observed as strings, which the summary casts back: an observation hands over dates,
    timestamps and decimals as Java objects, and the cast round trip is exact for every type of
    :data:`RANGE_TYPES`.
    """
    observation = Observation()
    observed = changes_df.observe(observation, *_change_counts(schema, fields)).drop(decode.ROW, logical.CONNECT_FIELDS)
    winners = None
    if ranked:
        winners = Observation()
        ranked_df = one_per_key(observed, schema.table.keys, late=True, by_log=log_order(schema.table))
        observed = ranked_df.observe(winners, *_winner_counts()).drop("_late")
    return observed.localCheckpoint(), observation, winners


@functools.lru_cache(maxsize=64)
def _change_counts(schema: TableSchema, fields: bool) -> tuple[Column, ...]:
    """What :func:`_observed` counts of every change (built once per schema, as the decode's expressions)."""
    ok, is_delete = F.col("_error").isNull(), F.col("_op") == "delete"
    key = F.col(f"`{schema.table.keys[0]}`")
    return (
        F.count(F.when(ok, 1)).alias("valid"),
        F.count(F.col("_error")).alias("rejected"),
        F.count(F.when(ok & is_delete, 1)).alias("deletes"),
        F.count(F.when(ok & F.col("_tombstone"), 1)).alias("tombstones"),
        F.min(F.when(ok, key)).cast("string").alias("low"),
        F.max(F.when(ok, key)).cast("string").alias("high"),
        F.min(F.when(ok & F.col("_tombstone"), key)).cast("string").alias("tombstone_low"),
        F.max(F.when(ok & F.col("_tombstone"), key)).cast("string").alias("tombstone_high"),
        F.count(F.lit(1)).alias("records"),
        *(evolution.observations(schema) if fields else []),
    )


@functools.lru_cache(maxsize=1)
def _winner_counts() -> tuple[Column, ...]:
    """What :func:`_observed` counts of the winners."""
    ok = F.col("_error").isNull()
    return (
        F.count(F.when(ok & (F.col("_op") == "upsert"), 1)).alias("upserts"),
        F.count(F.when(ok & (F.col("_op") == "delete"), 1)).alias("deletes"),
        F.count(F.when(F.col("_late"), 1)).alias("late"),
    )


def _summary(observation: Observation, winners: Observation | None, schema: TableSchema) -> _Summary:
    """What the decode's job counted of one table's changes."""
    row = observation.get
    key_type = schema.key_schema.fields[0].dataType
    ranked = winners.get if winners is not None else {"upserts": 0, "deletes": 0, "late": 0}
    return _Summary(
        int(row["valid"]),
        int(row["rejected"]),
        int(row["deletes"]),
        int(row["tombstones"]),
        (F.lit(row["low"]).cast(key_type), F.lit(row["high"]).cast(key_type)),
        (F.lit(row["tombstone_low"]).cast(key_type), F.lit(row["tombstone_high"]).cast(key_type)),
        int(row["records"]),
        int(ranked["upserts"]),
        int(ranked["deletes"]),
        int(ranked["late"]),
        evolution.new_fields(schema, row),
    )


#: Up to this many retained deletes (about 40 bytes each) are broadcast whole to a ranked batch's anti join; past
#: it, only those of the batch's keys are, found by a semi join of the retained deletes with the batch's keys.
RETAINED_BROADCAST_ROWS = BROADCAST_ROWS

#: A tombstone table as :meth:`_Retained._read` reads it: its rows, per app id the last batch it appended, and how
#: many rows they are.
_RetainedRead = tuple[DataFrame, dict[str, int], int]


class _Retained:
    """Each table's retained deletes (keys and versions): read from Delta once, then kept up to date in memory.

    The replica is the only writer that adds to its tombstone tables, so after the first read the deletes of its
    own batches are all that is new; reading the table every batch would cost a Delta snapshot and file listing
    (~0.5 s). Maintenance only drops deletes that no longer count, which do no harm here until the next start.
    A batch's deletes join the state once their append is committed, as one partition; every ``COMPACT_EVERY``
    batches the state is materialized again as one frame, of one partition while it is few enough to broadcast.
    The anti join broadcasts the whole state every batch, in a Spark job of a task per partition held, and each
    task costs more (its projections' code generated again) than its few rows do.
    """

    COMPACT_EVERY = 4

    def __init__(self) -> None:
        self.parts: dict[str, list[DataFrame]] = {}
        #: Per table, at most this many rows in ``parts`` (as read, plus each batch's valid deletes since).
        self.rows: dict[str, int] = {}
        self.reading: dict[str, futures.Future[_RetainedRead]] = {}  # reads started by prefetch, not yet taken
        #: Per table, the last batch of this handler's app whose deletes the table holds: as read, then as appended.
        self.last_committed: dict[str, int] = {}

    def prefetch(self, spark: SparkSession, schemas: list[TableSchema], pool: futures.Executor) -> None:
        """Start reading these tables' retained deletes on ``pool``: the read (a Delta snapshot and a scan, about a
        second) then runs while the query starts and the first batch decodes, instead of after them."""
        for schema in schemas:
            read = functools.partial(self._read_beside, spark, schema)
            self.reading[schema.table.name] = pool.submit(inheritable_thread_target(spark)(read))

    def cancel(self) -> None:
        """Drop the reads not started yet (a run that had no batch): the handler's close does not wait for them."""
        for reading in self.reading.values():
            reading.cancel()

    @classmethod
    def _read_beside(cls, spark: SparkSession, schema: TableSchema) -> _RetainedRead:
        """:meth:`_read` on a thread of its own, its jobs named for what they read (no batch stage names them)."""
        spark.sparkContext.setJobDescription(f"retained deletes of {schema.table.name}")
        return cls._read(spark, schema)

    @staticmethod
    def _read(spark: SparkSession, schema: TableSchema) -> _RetainedRead:
        """The table's retained deletes with the commit that appended each, materialized (a local checkpoint), and
        the last batch each app appended (see :meth:`committed`)."""
        target = tombstone_target(schema.table)
        tombstones = read_table(spark, target).select(*version_columns(schema.table.keys), "_app_id", "_batch_id")
        # An empty table (a new replica's) needs no scan, which on a starting JVM costs a second.
        if is_empty(spark, target):
            return spark.createDataFrame([], tombstones.schema), {}, 0
        read = tombstones.localCheckpoint()
        last = read.groupBy("_app_id").agg(F.max("_batch_id").alias("last"), F.count(F.lit(1)).alias("rows")).collect()
        return read, {str(row["_app_id"]): int(row["last"]) for row in last}, sum(int(row["rows"]) for row in last)

    def of(self, spark: SparkSession, schema: TableSchema, table_app: str, batch_id: int) -> DataFrame:
        """The table's retained deletes as ``keys + _src_partition, _src_offset, _src_seq``."""
        name = schema.table.name
        if name not in self.parts:
            reading = self.reading.pop(name, None)
            read, last, rows = reading.result() if reading is not None else self._read(spark, schema)
            # A re-run of this batch must not see the tombstones its first run wrote (see the module docstring).
            app = f"{table_app}:tombstones"
            own = (F.col("_app_id") == F.lit(app)) & (F.col("_batch_id") == batch_id)
            self.parts[name] = [read.where(~own).select(*version_columns(schema.table.keys))]
            self.last_committed[name] = last.get(app, -1)
            self.rows[name] = rows
        return reduce(DataFrame.unionByName, self.parts[name])

    def few(self, name: str) -> bool:
        """Whether the table's retained deletes held (read by :meth:`of`) are few enough to broadcast whole."""
        return self.rows.get(name, RETAINED_BROADCAST_ROWS + 1) <= RETAINED_BROADCAST_ROWS

    def none(self, name: str) -> bool:
        """Whether the table holds no retained deletes (read by :meth:`of`), nor did any batch add some since."""
        return self.rows.get(name) == 0

    def committed(self, name: str, batch_id: int) -> bool:
        """Whether this batch's deletes are in the tombstone table already, so they must not be appended again: a
        re-run's first run appended them (before a crash, or in this handler).

        The same rule as Delta's for an idempotent write (``txnVersion``), without reading the table's state on
        every commit: batches of one app run in order, so every batch up to the last one appended is done. That
        is known from the table when it is read (at the handler's first batch, and again after a failed append)
        and from this handler's own appends since.
        """
        return batch_id <= self.last_committed.get(name, -1)

    def appended(self, name: str, batch_id: int) -> None:
        """Note that this batch's deletes are committed to the table."""
        self.last_committed[name] = max(batch_id, self.last_committed.get(name, -1))

    def forget(self, name: str) -> None:
        """Read the table again at the next batch (an append failed: whether it committed is not known)."""
        self.parts.pop(name, None)
        self.rows.pop(name, None)
        self.last_committed.pop(name, None)

    def add(self, name: str, winners: _Winners, schema: TableSchema) -> None:
        """Add the winning deletes of a batch whose tombstones are committed."""
        winners_df = winners.df
        keys = [F.col(f"`{k}`") for k in schema.table.keys]
        deletes = winners_df.where(F.col("_op") == "delete").select(
            *keys,
            F.col("_partition").alias("_src_partition"),
            F.col("_offset").alias("_src_offset"),
            F.col("_seq").alias("_src_seq"),
        )
        parts = self.parts[name]
        parts.append(deletes.coalesce(1))  # at most a batch's
        self.rows[name] = self.rows.get(name, 0) + winners.deletes
        if len(parts) > self.COMPACT_EVERY:
            state = reduce(DataFrame.unionByName, parts)
            self.parts[name] = [(state.coalesce(1) if self.few(name) else state).localCheckpoint()]


class _Logged:
    """Per merge-on-read table, the last batch of the handler's generation that its change log holds.

    The same rule as Delta's for an idempotent write (``txnVersion``), without a Spark job over the log's state on
    every commit: batches of a generation commit in order, so every batch up to the last one appended is done. That
    is read from the log's history (each append carries its batch and generation, see
    :func:`replica_lib.progress.last_batch`) at the handler's first batch and after a failed append, and follows the
    handler's own appends since. A fold retires changes but not the commits that appended them.
    """

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.last: dict[str, int] = {}

    def committed(self, spark: SparkSession, table: TableConfig, generation: str, batch_id: int) -> bool:
        """Whether this batch's changes are in the table's change log already (a run of it before a restart, or in
        this handler, appended them)."""
        if table.name not in self.last:
            self.last[table.name] = last_batch(spark, changes_target(table), self.replica, generation)
        return batch_id <= self.last[table.name]

    def appended(self, name: str, batch_id: int) -> None:
        """Note that this batch's changes are committed to the table's change log."""
        self.last[name] = max(batch_id, self.last.get(name, -1))

    def forget(self, name: str) -> None:
        """Read the log's history again at the next batch (an append failed: whether it committed is not known)."""
        self.last.pop(name, None)


def _winners(
    spark: SparkSession,
    changes_df: DataFrame,
    summary: _Summary,
    schema: TableSchema,
    retained_df: DataFrame,
    rows_empty: bool,
    ranked: bool = False,
    retained_small: bool = False,
    retained_none: bool = False,
) -> _Winners | None:
    """The changes of this batch that win and are newer than what the tables hold, one per key; None if none.

    Changes are checked here against the retained deletes only (``retained_df``, see :class:`_Retained`); the
    MERGE checks them against the replica table's rows. The rows are read only for the keys of Kafka
    tombstones, which take the seq of the state they delete (the files in their key range, when data skipping
    allows).

    The tombstone table is a log: a key may have several retained deletes, and one older than its live row (a
    delete that lost to the row, or a key upserted again since). That is harmless: what any change is checked
    against is the greatest version among a key's row and retained deletes. ``jobs/maintain.py`` drops the
    superseded ones (:func:`replica_lib.maintenance.compact_tombstones`).

    ``ranked``: the changes are one per key already, ranked in the decode's job; they are only checked against
    the retained deletes (an anti join), and no rows are read, as a ranked table's tombstones inherit no seq.
    ``retained_small``: the retained deletes are few enough to broadcast whole to that anti join, which then
    shuffles nothing (without the hint, Spark's estimates of the in-memory frames chose a shuffle in some runs).
    ``retained_none``: there are none (a rebuild, a new replica): the ranked changes, materialized by the decode,
    are the winners as they are, counted already.
    """
    keys = list(schema.table.keys)
    by_log = log_order(schema.table)
    version_cols = version_columns(schema.table.keys)
    valid_df = decode.valid(changes_df)
    key = F.col(f"`{keys[0]}`")
    rows = summary.valid
    if rows == 0:
        return None
    ranged = len(keys) == 1 and isinstance(schema.key_schema.fields[0].dataType, RANGE_TYPES)
    key_range = KeyRange(keys[0], *summary.keys) if ranged else None
    if ranked and retained_none:  # one change per key already, and nothing retained to check them against
        ranked_rows = summary.ranked_upserts + summary.ranked_deletes
        return _Winners(valid_df, ranked_rows, summary.ranked_deletes, key_range, exact=True)
    if ranked and retained_small:  # one change per key already: only those newer than every known version remain
        winners_df = unapplied(valid_df, keys, F.broadcast(retained_df), by_log)
        return _Winners(winners_df.localCheckpoint(), rows, summary.deletes, key_range)
    batch_keys = valid_df.select(*keys).distinct()
    if rows <= BROADCAST_ROWS:
        batch_keys = F.broadcast(batch_keys)
    states = [retained_df.join(batch_keys, keys, "left_semi")]
    if summary.tombstones and not rows_empty and not ranked:
        rows_df = read_table(spark, schema.table.target)
        if ranged:
            rows_df = rows_df.where(key.between(*summary.tombstone_keys))
        tombstone_keys = valid_df.where(F.col("_tombstone")).select(*keys).distinct()
        states.append(rows_df.join(F.broadcast(tombstone_keys), keys, "left_semi").select(*version_cols))
    if ranked:
        winners_df = unapplied(valid_df, keys, reduce(DataFrame.unionByName, states), by_log)
    else:
        winners_df = latest_per_key(valid_df, keys, current_versions(keys, *states), by_log)
    return _Winners(winners_df.localCheckpoint(), rows, summary.deletes, key_range)


def _lost_materialized_rows(exc: BaseException) -> bool:
    """Whether ``exc`` (or a JVM exception it holds, or their causes) is Spark's error for a local checkpoint's
    block lost with its executor, by its error condition."""
    from pyspark import SparkContext

    if isinstance(exc, PySparkException) and exc.getCondition() == _LOST_CHECKPOINT_BLOCK:
        return True
    gateway = SparkContext._gateway
    return any(jvm_condition(gateway, cause) == _LOST_CHECKPOINT_BLOCK for cause in jvm_causes(exc))
