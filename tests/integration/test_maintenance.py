"""Maintenance beside the running replica, on a real broker, Spark and Delta."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from replica_dev.conf import orders_table
from replica_lib import batch
from replica_lib.errors import ConcurrentDeleteReadError
from replica_lib.merge import compact_files
from tests.integration.support import delete, produce, replica_config, run_available_now, upsert
from tests.integration.test_semantics import assert_matches_model

pytestmark = pytest.mark.integration


def test_a_merge_that_loses_to_a_concurrent_optimize_runs_again_on_the_new_version(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = topic_factory(partitions=2)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "retry", {"orders": orders_table(topic)})
    log = produce(connection, topic, [upsert(k, 1, "new") for k in range(10)])
    run_available_now(spark, cfg)
    log += produce(connection, topic, [upsert(k, 2, "paid") for k in range(5)] + [delete(5, 2)])

    # An operator's OPTIMIZE commits while the batch's MERGE runs: Delta refuses the MERGE's commit (it read files
    # the OPTIMIZE removed). The OPTIMIZE here is real; Delta's refusal is raised as Delta raises it.
    real_merge, calls = batch.merge_rows, []

    def losing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            compact_files(spark, cfg.table("orders").target, 1 << 30)
            raise ConcurrentDeleteReadError("[DELTA_CONCURRENT_DELETE_READ] This transaction attempted to read")
        return real_merge(*args, **kwargs)

    monkeypatch.setattr(batch, "merge_rows", losing_once)
    with caplog.at_level(logging.WARNING, logger="replica_lib.batch"):
        run_available_now(spark, cfg)
    assert len(calls) == 2
    assert any("merging again on its new version (attempt 2 of 5)" in r.getMessage() for r in caplog.records)
    assert_matches_model(spark, cfg, log)

