"""The same jobs on a real Spark standalone cluster (a master and two workers on loopback), through spark-submit.sh."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from replica_dev import loadgen
from replica_dev.chaos import Launch
from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_dev.spark_cluster import SparkStandalone
from replica_lib.config import load_replica
from replica_lib.producer import ChangeProducer, ProducerSettings
from replica_lib.rebuild import rebuild_config
from tests.conftest import C1_ONLY
from tests.integration.test_semantics import assert_matches_model

pytestmark = pytest.mark.integration

JOB_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkStandalone]:
    with SparkStandalone(tmp_path_factory.mktemp("spark-cluster"), workers=2, cores=1, memory="1g") as nodes:
        yield nodes


def test_a_replica_on_a_standalone_cluster_loses_an_executor_and_stays_exact_and_rebuilds_there(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, cluster: SparkStandalone
) -> None:
    topic = topic_factory(partitions=2)
    conf = tmp_path / "clustered.toml"
    # Checkpoint and tables on a disk every node sees (here all are on this machine; on a real cluster, HDFS or an
    # object store).
    doc = replica_doc(
        "clustered",
        tmp_path / "clustered",
        connection["bootstrap.servers"],
        {"orders": orders_table(topic)},
        source={"starting_offsets": "earliest", "max_offsets_per_trigger": 300},
    )
    write_replica(conf, doc)
    cfg = load_replica(conf)
    with ChangeProducer(connection, ProducerSettings()) as producer:
        # Three batches of 300: an executor is lost after the first, and the query goes on through the loss.
        log = loadgen.run(producer, topic, loadgen.Workload(keys=80, events=900, seed=41))

    # The executors live for these two jobs: like their drivers (tests/conftest.py), they compile with C1 only.
    on_cluster = ("--master", cluster.master_url, "--conf", f"spark.executor.extraJavaOptions={C1_ONLY}")
    job = Launch(conf, tmp_path / "materialize.log", None, args=("--available-now",), spark_options=on_cluster)
    try:
        job.wait_for_batch(JOB_TIMEOUT_S)  # the query runs on the executors: lose one of them mid-run
        cluster.kill_executor()
        assert job.wait_exit(JOB_TIMEOUT_S) == 0, job.log.read_text(errors="replace")[-3000:]
    finally:
        job.kill()
    text = job.log.read_text(errors="replace")
    assert "ExecutorLostFailure" in text or "Lost executor" in text  # the kill reached the query, which went on
    assert_matches_model(spark, cfg, log)

    # The rebuild job runs there too, and equals the replica.
    into = tmp_path / "rebuilt"
    args = ("--into", str(into), "--verify")
    rebuild = Launch(conf, tmp_path / "rebuild.log", None, job="jobs/rebuild.py", args=args, spark_options=on_cluster)
    assert rebuild.wait_exit(JOB_TIMEOUT_S) == 0, rebuild.log.read_text(errors="replace")[-3000:]
    assert "clustered.orders and rebuilt orders are equal" in rebuild.log.read_text(errors="replace")
    assert_matches_model(spark, rebuild_config(cfg, str(into)), log)
