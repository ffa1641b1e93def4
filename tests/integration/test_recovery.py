"""Checkpoint loss, checkpoints of other replicas, and data the log no longer holds."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.sql import SparkSession

from replica_lib.batch import BatchHooks, BatchStats
from replica_lib.errors import CheckpointError, DataLossError
from replica_lib.stream import start_replica
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import (
    RUN_TIMEOUT_S,
    delete,
    end_offsets,
    expected_df,
    orders_table,
    produce,
    replica_config,
    replica_df,
    run_available_now,
    upsert,
)

pytestmark = pytest.mark.integration


def test_a_lost_checkpoint_resumes_from_the_offsets_in_the_delta_commits(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic = topic_factory(partitions=3)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "lost", {"orders": orders_table(topic)})
    log = produce(connection, topic, [upsert(k, 1, "a") for k in range(30)] + [delete(1, 2)])
    run_available_now(spark, cfg)
    shutil.rmtree(cfg.checkpoint)
    newer = produce(connection, topic, [upsert(k, 2, "b") for k in range(5)] + [upsert(1, 3, "back")])
    log += newer

    stats: list[BatchStats] = []
    query = start_replica(spark, cfg, available_now=True, hooks=BatchHooks(after_batch=stats.append))
    try:
        assert query.awaitTermination(RUN_TIMEOUT_S)
    finally:
        query.stop()

    assert sum(s.records for s in stats) == len(newer)  # nothing before the recorded offsets was read again
    assert stats[-1].offsets == {topic: end_offsets(log)}
    assert_df_equality(
        replica_df(spark, cfg, "orders"),
        expected_df(spark, cfg, "orders", log),
        ignore_row_order=True,
        ignore_nullable=True,
    )


def test_another_replicas_checkpoint_is_refused(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic, other_topic = topic_factory(partitions=1), topic_factory(partitions=1)
    produce(connection, topic, [upsert(1, 1, "a")])
    first = replica_config(tmp_path, connection["bootstrap.servers"], "owner", {"orders": orders_table(topic)})
    run_available_now(spark, first)
    for name, table_topic in (("intruder", topic), ("owner", other_topic)):
        cfg = replica_config(
            tmp_path / name, connection["bootstrap.servers"], name, {"orders": orders_table(table_topic)}
        )
        cfg = type(cfg)(**{**cfg.__dict__, "checkpoint": first.checkpoint})
        with pytest.raises(CheckpointError, match=f"checkpoint {first.checkpoint} belongs to replica 'owner'"):
            start_replica(spark, cfg, available_now=True)


def test_records_deleted_unread_stop_the_replica_with_a_rebuild_hint(
    spark: SparkSession, connection: dict[str, str], tmp_path: Path
) -> None:
    topic = f"loss-{uuid.uuid4().hex[:8]}"
    admin = TopicAdmin(connection)
    admin.ensure(TopicSpec.local(topic, partitions=1, compact=False), local=True)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "loss", {"orders": orders_table(topic)})
    produce(connection, topic, [upsert(k, 1, "a") for k in range(3)])
    run_available_now(spark, cfg)
    unread = produce(connection, topic, [upsert(k, 2, "b") for k in range(3)])
    admin.delete_records_before(topic, {0: unread[-1].position.offset + 1})  # retention, before the replica ran

    with pytest.raises(DataLossError) as caught:
        start_replica(spark, cfg, available_now=True)
    message = str(caught.value)
    assert f"{topic}[0] offsets 3..5" in message
    assert "Rebuild it" in message and cfg.checkpoint in message
