"""The batch handler on its own: called directly on a static DataFrame, and failing inside a running query."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from replica_lib.batch import BatchHandler, BatchHooks
from replica_lib.config import COPY_ON_WRITE, MERGE_ON_READ, ReplicaConfig, Target
from replica_lib.errors import ConfigError
from replica_lib.merge import Commit, append_quarantine
from replica_lib.progress import REPLAY_GENERATION, applied_offsets, last_batch
from replica_lib.session import CHECKPOINT_FILE_MANAGER, FILE_SYSTEM_CHECKPOINT_FILES, replica_session
from replica_lib.stream import start_replica
from replica_lib.target import applied_target, delta_table, ensure_replica_tables, read_table, tombstone_target
from tests.integration.support import (
    RUN_TIMEOUT_S,
    delete,
    end_offsets,
    orders_table,
    produce,
    replica_config,
    run_available_now,
    tombstone,
    upsert,
)
from tests.integration.test_semantics import assert_matches_model, produce_raw

pytestmark = pytest.mark.integration


def _static_batch(spark: SparkSession, cfg: ReplicaConfig, topic: str) -> DataFrame:
    """The whole topic as one static DataFrame in the shape of Spark's Kafka source (what foreachBatch gets)."""
    return (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", cfg.kafka.bootstrap_servers)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("kafka.isolation.level", "read_committed")
        .load()
        .select("key", "value", "topic", "partition", "offset", "timestamp")
    )


def _checkpoint_of_one_batch(cfg: ReplicaConfig, topic: str, ends: dict[int, int]) -> None:
    """What Spark writes before it runs batch 0: the checkpoint's id and the batch's end offsets."""
    root = Path(cfg.checkpoint)
    (root / "offsets").mkdir(parents=True)
    (root / "metadata").write_text(json.dumps({"id": "handler-test"}))
    (root / "offsets" / "0").write_text(f"v1\n{{}}\n{json.dumps({topic: {str(p): o for p, o in ends.items()}})}")


@pytest.mark.parametrize("layout", [COPY_ON_WRITE, MERGE_ON_READ])
def test_the_handler_called_on_a_static_frame_applies_it_exactly_once(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, layout: str
) -> None:
    topic = topic_factory(partitions=2)
    orders = orders_table(topic, layout=layout)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "direct", {"orders": orders})
    log = produce(
        connection,
        topic,
        [upsert(1, 2, "b"), upsert(1, 1, "a-late"), upsert(2, 1, "x"), delete(2, 2), upsert(3, 1, "c"), tombstone(3)],
    )
    produce_raw(connection, topic, [(b'{"order_id": 9}', b"not json")])
    ends = end_offsets(log)
    ends_with_bad = {p: o for p, o in ends.items()}
    batch_df = _static_batch(spark, cfg, topic)
    for row in batch_df.select("partition", "offset").collect():
        ends_with_bad[row["partition"]] = max(ends_with_bad.get(row["partition"], 0), row["offset"] + 1)
    _checkpoint_of_one_batch(cfg, topic, ends_with_bad)
    session = replica_session(spark)
    schemas = ensure_replica_tables(session, cfg)
    stats = []
    # The table each batch commits to (the rows, or the change log), and the retained deletes.
    tables = (applied_target(cfg.table("orders")), tombstone_target(cfg.table("orders")))
    handler = BatchHandler(cfg, schemas, BatchHooks(after_batch=stats.append))
    try:
        handler(_static_batch(session, cfg, topic), 0)
        versions = [delta_table(spark, target).history(1).first()["version"] for target in tables]
        handler(_static_batch(session, cfg, topic), 0)  # Spark re-running the batch in the same process
    finally:
        handler.close()
    restarted = BatchHandler(cfg, schemas, BatchHooks(after_batch=stats.append))
    try:
        restarted(_static_batch(session, cfg, topic), 0)  # and after a crash
    finally:
        restarted.close()

    assert_matches_model(spark, cfg, log)
    assert [delta_table(spark, target).history(1).first()["version"] for target in tables] == versions
    quarantined = read_table(spark, cfg.quarantine).select("topic", "partition", "offset", "value").collect()
    assert len(quarantined) == 1 and bytes(quarantined[0]["value"]) == b"not json"
    assert (stats[0].records, stats[0].quarantined, stats[1].records, stats[2].records) == (7, 1, 7, 7)
    applied = applied_offsets(spark, applied_target(cfg.table("orders")))
    assert applied is not None and applied.offsets == {topic: ends_with_bad}


def test_the_last_batch_of_a_generation_is_the_newest_commit_of_it_before_another_generation(
    spark: SparkSession, tmp_path: Path
) -> None:
    log = Target(path=str(tmp_path / "log"))
    rows = spark.createDataFrame([(1,)], "k INT")

    def commit(replica: str, generation: str, batch_id: int) -> None:
        metadata = {"replica": replica, "batch_id": batch_id, "generation": generation, "offsets": {}}
        append_quarantine(log, rows, Commit(f"{replica}:{generation}", batch_id, metadata))

    def last(generation: str, replica: str = "r") -> int:
        return last_batch(spark, log, replica, generation)

    commit("r", "g1", 0)
    commit("r", "g1", 1)
    commit("r", REPLAY_GENERATION, 1_800_000_000_000)  # a replay between two batches of g1
    rows.write.format("delta").mode("append").save(log.path)  # a commit of no replica (a compaction, a user)
    commit("other", "g9", 7)
    assert (last("g1"), last("g2"), last(REPLAY_GENERATION), last("g9", "other")) == (1, -1, 1_800_000_000_000, 7)
    commit("r", "g2", 0)  # a new generation (a new checkpoint) ends the search for g1's
    assert (last("g1"), last("g2"), last(REPLAY_GENERATION)) == (-1, 0, -1)


class _Boom(Exception):
    """The failure a hook injects into a batch."""


def test_a_failing_handler_fails_the_query_and_the_restart_applies_everything_once(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic = topic_factory(partitions=2)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "failing", {"orders": orders_table(topic)})
    log = produce(connection, topic, [upsert(k, 1, "v1") for k in range(20)] + [delete(3, 2), upsert(4, 2, "v2")])

    def fail_after_quarantine(point: str, batch_id: int) -> None:
        if point == "after_quarantine":
            raise _Boom(f"injected failure in batch {batch_id}")

    query = start_replica(spark, cfg, available_now=True, hooks=BatchHooks(at=fail_after_quarantine))
    try:
        with pytest.raises(StreamingQueryException, match="injected failure in batch 0"):
            query.awaitTermination(RUN_TIMEOUT_S)
    finally:
        query.stop()
    assert applied_offsets(spark, cfg.table("orders").target) is None  # nothing of the batch was committed

    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)
    applied = applied_offsets(spark, cfg.table("orders").target)
    assert applied is not None and applied.offsets == {topic: end_offsets(log)}


def test_a_topic_that_does_not_exist_is_one_line_before_anything_is_created(
    spark: SparkSession, connection: dict[str, str], tmp_path: Path
) -> None:
    topic = f"missing-{uuid.uuid4().hex[:8]}"
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "nowhere", {"orders": orders_table(topic)})
    with pytest.raises(ConfigError) as refused:
        start_replica(spark, cfg, available_now=True)
    assert str(refused.value) == (
        f"nowhere.toml: tables.orders.topic: topic {topic!r} does not exist on {connection['bootstrap.servers']} "
        "(fix: create the topic before the replica starts, or correct its name)"
    )
    assert not (tmp_path / "nowhere" / "orders").exists()


def test_a_replica_session_on_a_local_checkpoint_takes_the_file_system_checkpoint_manager(spark: SparkSession) -> None:
    local = replica_session(spark, local_checkpoint=True)
    assert local.conf.get(CHECKPOINT_FILE_MANAGER) == FILE_SYSTEM_CHECKPOINT_FILES
    assert replica_session(spark).conf.get(CHECKPOINT_FILE_MANAGER, None) is None  # other storage: Spark's own
