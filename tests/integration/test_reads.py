"""Per-batch metrics, freshest-replica reads and read-your-writes, on a real broker, Spark and Delta."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession

from jobs.sql import main as sql_main
from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_dev.model import LoggedChange
from replica_lib.config import PROJECT_ROOT, ReplicaConfig, load_replica
from replica_lib.errors import NotAppliedError
from replica_lib.layout import fold as fold_changes
from replica_lib.progress import applied_offsets
from replica_lib.reads import freshest, snapshot_at, wait_for
from replica_lib.stream import run_replica, start_replica
from replica_lib.target import current_schema, read_table
from tests.integration.support import (
    delete,
    end_offsets,
    expected_df,
    produce,
    produce_garbage,
    replica_config,
    run_available_now,
    upsert,
)
from tests.integration.test_semantics import assert_matches_model

pytestmark = pytest.mark.integration


def _replica(tmp_path: Path, name: str, bootstrap: str, topic: str, **replica: Any) -> tuple[str, ReplicaConfig]:
    path = tmp_path / f"{name}.toml"
    doc = replica_doc(
        name,
        tmp_path / name,
        bootstrap,
        {"orders": orders_table(topic)},
        replica=replica,
        source={"starting_offsets": "earliest", "max_offsets_per_trigger": 60},
        trigger={"available_now": True, "interval": "1 second"},
    )
    write_replica(path, doc)
    return str(path), load_replica(path)


def test_metrics_records_match_the_log_and_the_table(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = topic_factory(partitions=2)
    metrics_path = tmp_path / "metrics"
    conf, cfg = _replica(
        tmp_path, "metered", connection["bootstrap.servers"], topic, metrics={"path": str(metrics_path)}
    )
    log = produce(connection, topic, [upsert(k, s, f"s{s}") for s in (1, 2) for k in range(50)])
    log += produce(connection, topic, [delete(k, 3) for k in range(0, 50, 5)] + [upsert(1, 1, "stale")])
    garbage = produce_garbage(connection, topic, partition=1)

    run_replica(spark, cfg, available_now=True)

    assert_matches_model(spark, cfg, log)
    records = [row.asDict(recursive=True) for row in spark.read.format("delta").load(str(metrics_path)).collect()]
    records.sort(key=lambda r: r["batch_id"])
    assert [r["batch_id"] for r in records] == list(range(len(records)))
    assert len(records) >= 2  # 60 offsets per trigger over 112 records
    assert sum(r["records"] for r in records) == len(log) + 1
    assert sum(r["quarantined"] for r in records) == 1
    (quarantined,) = read_table(spark, cfg.quarantine).select("partition", "offset").collect()
    assert (quarantined["partition"], quarantined["offset"]) == (1, garbage)
    for r in records:
        assert r["records"] == r["upserts"] + r["deletes"] + r["unchanged"] + r["quarantined"]
        assert set(r["stages"]) >= {"decode", "orders: merge"} or r["records"] == 0
    assert sum(r["deletes"] for r in records) == 10
    assert sum(r["unchanged"] for r in records) >= 1  # the stale upsert of key 1 lost to its seq 2
    # Each record's offsets are those the table's commit of that batch recorded; the last batch drained the log.
    commits = [
        json.loads(row["userMetadata"])
        for row in DeltaTable.forPath(spark, str(cfg.table("orders").target.path)).history().collect()
        if row["userMetadata"]
    ]
    assert commits
    by_batch = {r["batch_id"]: r["offsets"][topic] for r in records}
    for commit in commits:
        assert by_batch[commit["batch_id"]] == {int(p): o for p, o in commit["offsets"][topic].items()}
    applied = applied_offsets(spark, cfg.table("orders").target)
    assert applied is not None
    assert records[-1]["offsets"][topic] == applied.offsets[topic] == {0: end_offsets(log)[0], 1: garbage + 1}
    assert records[-1]["offsets_behind_max"] == 0

    # The metrics notebook plots this table.
    monkeypatch.setenv("REPLICA_CONF", conf)
    namespace: dict[str, Any] = {}
    notebook = json.loads((PROJECT_ROOT / "notebooks" / "replica_metrics.ipynb").read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "replica_metrics.ipynb", "exec"), namespace)
    assert [b["batch_id"] for b in namespace["batches"]] == [r["batch_id"] for r in records]
    assert Path(namespace["figure"]).stat().st_size > 0


def test_a_started_replica_stopped_has_written_its_metrics_and_left_no_listener(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """start_replica's stop() ends as run_replica does: the last batch's metrics are in the table, and the query's
    metrics listener is gone from its session (a notebook that starts and stops replicas keeps none)."""
    topic = topic_factory(partitions=2)
    metrics_path = tmp_path / "metrics"
    _, cfg = _replica(tmp_path, "started", connection["bootstrap.servers"], topic, metrics={"path": str(metrics_path)})
    log = produce(connection, topic, [upsert(k, 1, "new") for k in range(100)])
    query = start_replica(spark, cfg, available_now=True)
    streams = query._jsq.sparkSession().streams()
    assert len(streams.listListeners()) == 1
    try:
        assert query.awaitTermination(120)
    finally:
        query.stop()
    assert len(streams.listListeners()) == 0
    batches = sorted(int(p.name) for p in (Path(cfg.checkpoint) / "commits").glob("[0-9]*"))
    records = spark.read.format("delta").load(str(metrics_path)).select("batch_id", "records").collect()
    assert sorted(r["batch_id"] for r in records) == batches and len(batches) >= 2  # 60 offsets per trigger
    assert sum(r["records"] for r in records) == len(log)
    assert_matches_model(spark, cfg, log)


def test_freshest_replica_and_read_your_writes(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    topic = topic_factory(partitions=2)
    bootstrap = connection["bootstrap.servers"]
    conf_a, a = _replica(tmp_path, "fresh_a", bootstrap, topic)
    conf_b, b = _replica(tmp_path, "fresh_b", bootstrap, topic)
    first = produce(connection, topic, [upsert(k, 1, "new") for k in range(30)])
    run_replica(spark, b, available_now=True)
    second = produce(connection, topic, [upsert(k, 2, "paid") for k in range(0, 30, 2)])
    run_replica(spark, a, available_now=True)  # b stays behind: stopped

    # Monotonic reads: whichever order they are given in, the freshest replica is read.
    for order in ([b, a], [a, b]):
        chosen = freshest(spark, order, "orders")
        assert chosen.replica.name == "fresh_a"
        assert_rows(spark, chosen.read(spark), a, first + second)
    assert_rows(spark, freshest(spark, [b], "orders").read(spark), b, first)

    # Read-your-writes: a write no replica has applied times out, saying how far each one is.
    (write,) = produce(connection, topic, [upsert(999, 1, "mine")])
    p = write.position
    with pytest.raises(NotAppliedError) as refused:
        wait_for(spark, [b, a], "orders", [p], timeout_s=1.0)
    a_at = end_offsets(first + second).get(p.partition, 0)
    assert f"fresh_a ({topic}:{p.partition} at {a_at}, needs {p.offset + 1})" in str(refused.value)
    assert "fresh_b" in str(refused.value)

    # Once a running replica applies it, the read is pinned at a version that holds it.
    query = start_replica(spark, b, available_now=False)
    try:
        snapshot = wait_for(spark, [a, b], "orders", [p], timeout_s=180)
    finally:
        query.stop()
    assert snapshot.replica.name == "fresh_b"
    assert_rows(spark, snapshot.read(spark), b, first + second + [write])

    # The CLI form: the freshest of the replicas that applied the write, its rows as JSON lines.
    out = tmp_path / "rows.jsonl"
    after = f"{topic}:{p.partition}:{p.offset}"
    query_text = "SELECT order_id, status FROM orders WHERE order_id = 999"
    assert sql_main([conf_a, conf_b, "--after", after, "--timeout", "60", query_text, "--output", str(out)]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"order_id": 999, "status": "mine"}]
    assert sql_main([conf_a, query_text, "--after", after, "--timeout", "0.5"]) == 2  # a never applied it

    # The replicas' status is a view too: a is one record (the write) behind, b none.
    lag_query = "SELECT replica, sum(lag) AS lag FROM replica_status GROUP BY replica ORDER BY replica"
    assert sql_main([conf_a, conf_b, lag_query, "--output", str(out)]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"replica": "fresh_a", "lag": 1},
        {"replica": "fresh_b", "lag": 0},
    ]

    # A query that Spark refuses is one line, without the trace PySpark logs for it.
    capfd.readouterr()
    assert sql_main([conf_b, "SELECT no_such_column FROM orders"]) == 2
    captured = capfd.readouterr()
    assert "Traceback" not in captured.out + captured.err and "\tat org." not in captured.out + captured.err
    assert [line for line in captured.err.splitlines() if line.startswith("error:")] == [
        line for line in captured.err.splitlines() if "UNRESOLVED_COLUMN" in line
    ]


def test_a_merge_on_read_snapshot_at_a_past_position_is_the_state_then_across_folds(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    # The base holds what folds applied since: read now beside the change log of then, it showed later rows.
    topic = topic_factory(partitions=2)
    spec = orders_table(topic, layout="merge-on-read", fold_every_batches=0)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "travel", {"orders": spec})
    plain = upsert(2, 2, "x")
    assert plain.data is not None
    noted = dataclasses.replace(plain, data={**plain.data, "note": "a column added by this batch"})
    batches = [
        [upsert(1, 1, "a"), upsert(4, 1, "d")],
        [upsert(1, 2, "b"), noted],
        [delete(2, 3), upsert(3, 3, "c"), delete(4, 3)],
        [upsert(2, 4, "back")],
    ]
    log: list[LoggedChange] = []
    ends = []
    for i, changes in enumerate(batches):
        log += produce(connection, topic, changes)
        ends.append(len(log))
        run_available_now(spark, cfg)
        if i in (1, 2):  # the base and the retained deletes move on past the first batches
            fold_changes(spark, cfg.name, current_schema(spark, cfg.table("orders")))
    for end in ends:
        snapshot = snapshot_at(spark, cfg, "orders", [change.position for change in log[:end]])
        expected = expected_df(spark, cfg, "orders", log[:end])
        assert_df_equality(
            snapshot.read(spark).select(*expected.columns),
            expected,
            ignore_row_order=True,
            ignore_nullable=True,
        )


def assert_rows(spark: SparkSession, frame: DataFrame, cfg: ReplicaConfig, log: list[LoggedChange]) -> None:
    assert_df_equality(
        frame.drop("_src_event_ts"),
        expected_df(spark, cfg, "orders", log),
        ignore_row_order=True,
        ignore_nullable=True,
    )
