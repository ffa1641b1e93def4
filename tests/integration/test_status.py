"""Replica status and lag on a real broker, Spark and Delta; the replica's consumer group as Kafka's tools show it."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from pyspark.sql import SparkSession

from jobs.status import main as status_main
from replica_dev import maven
from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_dev.model import LoggedChange
from replica_lib.config import LocalSettings, ReplicaConfig, load_replica
from replica_lib.monitor import group_id
from replica_lib.progress import applied_offsets
from replica_lib.status import ReplicaStatus, Thresholds, replica_status, status_df
from replica_lib.stream import run_replica
from replica_lib.topics import TopicAdmin
from tests.integration.support import end_offsets, produce, produce_garbage, upsert
from tests.integration.test_semantics import assert_matches_model

pytestmark = pytest.mark.integration

CONSUMER_GROUP_COMMAND = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"
EVENT_S = 1_700_000_000.0  # the event time support.upsert gives every change


@pytest.fixture(scope="module")
def tools_classpath(settings: LocalSettings) -> str:
    """The classpath of Kafka's tools (resolved from Maven Central once, then cached like the broker's jars)."""
    java = maven.find_java(settings.java_home)
    jars = maven.resolve_jars(java, maven.KAFKA_TOOLS_PACKAGES, settings.state_dir, "kafka-tools")
    return ":".join(str(jar) for jar in jars)


def _replica_file(
    tmp_path: Path, name: str, bootstrap: str, topic: str, file: str | None = None
) -> tuple[str, ReplicaConfig]:
    path = tmp_path / f"{file or name}.toml"
    doc = replica_doc(
        name, tmp_path / name, bootstrap, {"orders": orders_table(topic)}, trigger={"available_now": True}
    )
    write_replica(path, doc)
    return str(path), load_replica(path)


def _per_partition(log: list[LoggedChange], partitions: int) -> dict[int, int]:
    counts = Counter(event.position.partition for event in log)
    return {p: counts[p] for p in range(partitions)}


def _lags(status: ReplicaStatus) -> dict[int, int | None]:
    (table,) = status.tables
    return {p.partition: p.lag for p in table.partitions}


def _group_offsets(connection: dict[str, str], group: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({**connection, "group.id": group, "enable.auto.commit": False})
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=30)
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in committed}


def _describe_group(
    classpath: str, java: str, bootstrap: str, group: str, topic: str
) -> dict[int, tuple[int, int, int]]:
    """What ``kafka-consumer-groups.sh --describe`` prints for ``topic``: partition -> (current, log end, lag)."""
    out = subprocess.run(
        [
            java,
            "-cp",
            classpath,
            CONSUMER_GROUP_COMMAND,
            "--bootstrap-server",
            bootstrap,
            "--describe",
            "--group",
            group,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = [line.split() for line in out.splitlines() if line.strip()]
    header = next(i for i, cells in enumerate(lines) if cells[:2] == ["GROUP", "TOPIC"])
    columns = lines[header]
    rows = {}
    for cells in lines[header + 1 :]:
        row = dict(zip(columns, cells, strict=False))
        if row.get("TOPIC") == topic:
            rows[int(row["PARTITION"])] = (int(row["CURRENT-OFFSET"]), int(row["LOG-END-OFFSET"]), int(row["LAG"]))
    return rows


def test_lag_before_and_after_a_run_and_in_the_replicas_consumer_group(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    settings: LocalSettings,
    tools_classpath: str,
) -> None:
    topic = topic_factory(partitions=3)
    bootstrap = connection["bootstrap.servers"]
    conf, cfg = _replica_file(tmp_path, "status_a", bootstrap, topic)
    admin = TopicAdmin(connection)
    first = produce(connection, topic, [upsert(k, s, f"s{s}") for s in (1, 2) for k in range(40)])
    garbage_offset = produce_garbage(connection, topic, partition=0)
    first_counts = _per_partition(first, 3)
    first_counts[0] += 1

    # Before the replica ever ran: everything in the log is lag, and the missing table makes it unhealthy.
    before = replica_status(spark, cfg, admin)
    assert _lags(before) == first_counts
    assert before.lag_records == 81
    assert not before.healthy
    assert before.tables[0].unhealthy == (
        f"no Delta table at delta.`{tmp_path / 'status_a' / 'orders'}` yet: run the replica",
    )

    started_s = time.time()
    run_replica(spark, cfg, available_now=True)
    finished_s = time.time()
    assert_matches_model(spark, cfg, first)

    # After it: nothing behind, and what the tables say of themselves.
    after = replica_status(spark, cfg, admin, Thresholds(max_lag_records=0))
    ends = end_offsets(first)
    ends[0] = max(ends.get(0, 0), garbage_offset + 1)
    (table,) = after.tables
    assert {p.partition: (p.applied, p.end, p.lag) for p in table.partitions} == {
        p: (ends[p], ends[p], 0) for p in range(3)
    }
    assert after.lag_records == 0
    assert after.healthy
    assert (table.rows, table.quarantined, table.batch_id, table.newest_event_s) == (40, 1, 0, EVENT_S)
    assert table.last_commit_s is not None and started_s - 1 <= table.last_commit_s <= finished_s + 1
    recorded = applied_offsets(spark, cfg.table("orders").target)
    assert recorded is not None and recorded.offsets == {topic: ends}
    assert table.version == recorded.version

    # The replica's consumer group holds exactly the offsets its Delta commit recorded.
    group = group_id(cfg.name)
    assert _group_offsets(connection, group, topic, 3) == ends

    # More changes after the run: the lag is exactly what was produced, per partition and in total.
    second = produce(connection, topic, [upsert(k, 3, "s3") for k in range(0, 40, 3)])
    second_counts = _per_partition(second, 3)
    behind = replica_status(spark, cfg, admin, Thresholds(max_lag_records=0))
    assert _lags(behind) == second_counts
    assert behind.lag_records == len(second) == 14
    assert behind.tables[0].unhealthy == ("14 records behind, over 0",)
    # Kafka's tool (one JVM launch, here where the lag is not 0) shows the group at the recorded offsets, the log's
    # new end and the same lag.
    java = maven.find_java(settings.java_home).executable
    assert _describe_group(tools_classpath, java, bootstrap, group, topic) == {
        p: (ends[p], ends[p] + second_counts[p], second_counts[p]) for p in range(3)
    }

    # As SQL rows: one per partition.
    rows = {
        r["partition"]: (r["applied"], r["end"], r["lag"], r["healthy"]) for r in status_df(spark, [behind]).collect()
    }
    assert rows == {p: (ends[p], ends[p] + second_counts[p], second_counts[p], False) for p in range(3)}

    # The command: exit 1 past a threshold of 0 records, 0 within the default thresholds, JSON for machines.
    assert status_main([conf, "--max-lag-records", "0"]) == 1
    assert status_main([conf]) == 0
    run_replica(spark, cfg, available_now=True)
    assert_matches_model(spark, cfg, first + second)
    assert status_main([conf, "--max-lag-records", "0"]) == 0
    ends = end_offsets(first + second)
    ends[0] = max(ends.get(0, 0), garbage_offset + 1)
    assert _group_offsets(connection, group, topic, 3) == ends


def test_the_command_prints_a_table_and_json_and_fails_for_an_unreachable_broker(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = topic_factory(partitions=2)
    conf, cfg = _replica_file(tmp_path, "status_b", connection["bootstrap.servers"], topic)
    log = produce(connection, topic, [upsert(k, 1, "new") for k in range(10)])
    run_replica(spark, cfg, available_now=True)
    more = produce(connection, topic, [upsert(k, 2, "newer") for k in range(5)])
    capsys.readouterr()

    assert status_main([conf, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (replica,) = doc["replicas"]
    assert (doc["healthy"], replica["replica"], replica["lag_records"]) == (True, "status_b", 5)
    (table,) = replica["tables"]
    ends = end_offsets(log)
    assert {p["partition"]: (p["applied"], p["lag"]) for p in table["partitions"]} == {
        p: (ends[p], n) for p, n in _per_partition(more, 2).items()
    }
    assert (table["rows"], table["quarantined"], table["batch_id"]) == (10, 0, 0)

    assert status_main([conf, "--max-lag-records", "4"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["REPLICA", "TABLE", "TOPIC", "LAG"]
    assert out[1].split()[:4] == ["status_b", "orders", topic, "5"]
    assert out[1].split()[-1] == "UNHEALTHY"
    assert out[2] == "status_b.orders: 5 records behind, over 4"

    # A broker that does not answer: exit 1, and the status still shows what the tables say.
    down_conf, _ = _replica_file(tmp_path, "status_b", "127.0.0.1:1", topic, file="status_b_down")
    assert status_main([down_conf]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.out.splitlines()
    assert lines[1].split()[:4] == ["status_b", "orders", topic, "-"]
    assert lines[2].startswith("status_b: cannot reach Kafka at 127.0.0.1:1")
