"""Start and run one replica: one Structured Streaming query, named after the replica."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from replica_lib.batch import BatchHandler, BatchHooks
from replica_lib.catalog import register_on_start
from replica_lib.config import ReplicaConfig
from replica_lib.errors import ReplicaError, TopicError
from replica_lib.metrics import BatchMetrics
from replica_lib.recovery import (
    applied_so_far,
    check_checkpoint,
    check_log_still_holds,
    check_partitions,
    check_topics_kept,
    checkpoint_is_local,
    claim_checkpoint,
    explain,
    lock_checkpoint,
    starting_offsets,
)
from replica_lib.session import replica_session
from replica_lib.source import check_reachable, read_changes
from replica_lib.target import ensure_replica_tables
from replica_lib.topics import TopicAdmin

logger = logging.getLogger(__name__)


class ReplicaQuery(StreamingQuery):
    """The replica's streaming query; :meth:`stop` also waits for a fold of merge-on-read tables still running
    beside it (see ``replica_lib.batch``), so that what follows a stop finds no write of the replica in flight, and
    for the metrics of its last batch, then removes its metrics listener (as :func:`run_replica` does at its end):
    a process that starts and stops replicas keeps no listener of a stopped one."""

    def __init__(self, query: StreamingQuery, handler: BatchHandler, metrics: BatchMetrics) -> None:
        super().__init__(query._jsq)
        self._handler = handler
        self._metrics: BatchMetrics | None = metrics

    def stop(self) -> None:
        super().stop()
        self._handler.close()
        metrics, self._metrics = self._metrics, None
        if metrics is not None:  # once: a second stop has nothing to wait for
            metrics.close(self._handler.last_batch, str(self.runId))


def start_replica(
    spark: SparkSession,
    cfg: ReplicaConfig,
    available_now: bool | None = None,
    hooks: BatchHooks | None = None,
    stop_requested: Callable[[], bool] | None = None,
    register: bool = True,
) -> StreamingQuery:
    """Check the checkpoint and the log, create missing tables, then start the replica's query.

    Stop it with ``stop()``, which returns once a fold still running beside its batches has ended and the metrics
    of its last batch are written (its metrics listener then leaves the session). The query
    runs in its own session (so its Delta write confs are its own) and is named after the replica.
    ``register=False``: leave the replica's names out of the catalog (a throwaway replica, such as the
    benchmark's, whose tables are gone when it ends).
    """
    query, handler, metrics = _start(spark, cfg, available_now, hooks, stop_requested, register)
    return ReplicaQuery(query, handler, metrics)


def _start(
    spark: SparkSession,
    cfg: ReplicaConfig,
    available_now: bool | None,
    hooks: BatchHooks | None,
    stop_requested: Callable[[], bool] | None,
    register: bool = True,
) -> tuple[StreamingQuery, BatchHandler, BatchMetrics]:
    # The file was checked when it was loaded; what needs storage comes next, and the broker only then, so that a
    # refused checkpoint creates no table and a bad checkpoint is not reported as an unreachable broker.
    lock_checkpoint(cfg)
    session = replica_session(spark, local_checkpoint=checkpoint_is_local(cfg))
    check_checkpoint(session, cfg)
    check_reachable(cfg)
    schemas = ensure_replica_tables(session, cfg)
    quarantine_id = claim_checkpoint(session, cfg)
    topic_ids = _check_the_log(session, cfg)
    if register:
        register_on_start(session, cfg)  # its catalog names (replica_lib.catalog); never fails the start
    metrics = BatchMetrics(session, cfg)
    session.streams.addListener(metrics)
    handler = BatchHandler(
        cfg, schemas, hooks, stop_requested, report=metrics.record, topic_ids=topic_ids, quarantine_id=quarantine_id
    )
    writer = (
        handler.stream(read_changes(session, cfg, starting_offsets(session, cfg)))
        .writeStream.queryName(cfg.name)
        .option("checkpointLocation", cfg.checkpoint)
        .foreachBatch(handler)
    )
    once = cfg.trigger.available_now if available_now is None else available_now
    writer = writer.trigger(availableNow=True) if once else writer.trigger(processingTime=cfg.trigger.interval)
    handler.prefetch(session)
    handler.fold_pending(session)
    try:
        query = writer.start()
    except BaseException:
        handler.close()  # the read it started beside the start ends with it
        raise
    logger.info(
        "replica %s started (query id %s, checkpoint %s, topics %s, %s)",
        cfg.name,
        query.id,
        cfg.checkpoint,
        ",".join(cfg.topics),
        "available-now" if once else f"every {cfg.trigger.interval}",
    )
    return query, handler, metrics


def _check_the_log(spark: SparkSession, cfg: ReplicaConfig) -> dict[str, str]:
    """Before the start: its topics are the ones it applied (not deleted and created again), the log still holds
    what the replica has not applied, and its topics kept their partition count where a table needs it
    (``recovery``). Returns the topics' ids, which its commits record. Skipped where the Python client cannot
    connect."""
    client = cfg.kafka.client_config()
    if client.settings is None:  # e.g. a JKS trust store or a Kerberos login: Spark's Java client only
        logger.warning("replica %s: not checking the log's start offsets before the start: %s", cfg.name, client.reason)
        return {}
    try:
        admin = TopicAdmin(client.settings)
        ids = admin.topic_ids(list(cfg.topics))
    except TopicError as exc:
        logger.warning("replica %s: could not check the log's topics (%s); Spark will check", cfg.name, exc)
        return {}
    check_topics_kept(spark, cfg, ids)
    applied = applied_so_far(spark, cfg)
    if not applied:
        return ids
    try:
        log_start = {topic: admin.earliest_offsets(topic) for topic in applied}
    except TopicError as exc:
        logger.warning("replica %s: could not check the log's start offsets (%s); Spark will check", cfg.name, exc)
        return ids
    check_log_still_holds(applied, log_start, cfg)
    check_partitions(cfg, applied, log_start, "seen when the replica started")
    return ids


def run_replica(
    spark: SparkSession, cfg: ReplicaConfig, available_now: bool | None = None, hooks: BatchHooks | None = None
) -> None:
    """Run until the log is drained (available-now) or until SIGTERM/Ctrl-C, which stop after the current batch.

    Raises the query's ``StreamingQueryException`` if a batch fails.
    """
    stop = threading.Event()
    query, handler, metrics = _start(spark, cfg, available_now, hooks, stop.is_set)

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        logger.info("replica %s: %s received, stopping after the current batch", cfg.name, signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while query.isActive and not stop.is_set():
            query.awaitTermination(1)
            if handler.fold_failed():  # it would fail the next batch, which may be long in coming: stop now
                stop.set()
        if stop.is_set() and query.isActive:
            # The batch in flight finishes; the next one is refused before any write (StopRequested).
            while query.isActive and query.status["isTriggerActive"]:
                query.awaitTermination(1)
            query.stop()
        query.awaitTermination()  # re-raises a failure of the query
        handler.wait_for_folds()  # and what the last fold beside the batches raised
    except StreamingQueryException as exc:
        if handler.refused is not None:  # the handler refused a batch because a stop was requested
            handler.wait_for_folds()
            logger.info("replica %s stopped", cfg.name)
            return
        if isinstance(handler.failure, ReplicaError):  # a batch refused to go on, and said why
            raise handler.failure from exc
        explained = explain(exc, cfg, handler.failure)
        if explained is not None:
            raise explained from exc
        raise
    finally:
        for sig, previous_handler in previous.items():
            signal.signal(sig, previous_handler)
        handler.close()
        metrics.close(handler.last_batch, str(query.runId))
    logger.info("replica %s stopped", cfg.name)
