"""The walking skeleton and the materializer, against the real broker, Spark and Delta."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_dev import loadgen
from replica_lib.producer import ChangeProducer
from replica_lib.progress import applied_offsets
from replica_lib.views import register_views
from tests.integration.support import (
    end_offsets,
    expected_df,
    orders_table,
    replica_config,
    replica_df,
    run_available_now,
)

pytestmark = pytest.mark.integration


def test_skeleton_events_to_delta_to_sql(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic = topic_factory(partitions=3)
    with ChangeProducer(connection) as producer:
        logged = loadgen.run(producer, topic, loadgen.Workload(keys=50, events=600, seed=11))
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "skeleton", {"orders": orders_table(topic)})

    run_available_now(spark, cfg)

    assert_df_equality(
        replica_df(spark, cfg, "orders"),
        expected_df(spark, cfg, "orders", logged),
        ignore_row_order=True,
        ignore_nullable=True,
    )
    register_views(spark, cfg)
    by_sql = spark.sql("SELECT order_id, status FROM orders WHERE status IS NOT NULL")
    assert_df_equality(
        by_sql,
        expected_df(spark, cfg, "orders", logged).select("order_id", "status"),
        ignore_row_order=True,
        ignore_nullable=True,
    )
    # Event time comes from the envelope's ts_ms, which the demo primary also stores as updated_ms.
    mismatched = (
        replica_df(spark, cfg, "orders")
        .sparkSession.read.format("delta")
        .load(cfg.table("orders").target.path or "")
        .where(F.col("_src_event_ts") != F.timestamp_millis("updated_ms"))
        .count()
    )
    assert mismatched == 0
    applied = applied_offsets(spark, cfg.table("orders").target)
    assert applied is not None
    assert applied.offsets == {topic: end_offsets(logged)}
    assert applied.replica == "skeleton"
