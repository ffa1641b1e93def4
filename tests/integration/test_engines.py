"""Replica tables read by an engine other than Spark: delta-rs (the ``deltalake`` package), per table setting.

A table's ``deletion_vectors`` decides which readers open it: with them, delta-rs's DataFusion reader does and its
pyarrow reader refuses the table outright; without them, both do. Each read must equal the reference model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import DeltaProtocolError
from pyspark.sql import SparkSession

from replica_dev.model import LoggedChange, fold
from replica_lib import merge
from replica_lib.errors import ConfigError
from replica_lib.target import ensure_replica_tables
from tests.integration.support import delete, produce, replica_config, run_available_now, upsert
from tests.integration.test_semantics import assert_matches_model

pytestmark = pytest.mark.integration

COLUMNS = ["order_id", "customer", "amount", "status", "updated_ms"]


def _model(log: list[LoggedChange], table: str) -> list[tuple[Any, ...]]:
    rows = fold([e for e in log if e.table == table], {table: ("order_id",)}, {table: True})[table]
    return sorted(tuple(row[c] for c in COLUMNS) for row in rows.values())


def _rows(table: Any) -> list[tuple[Any, ...]]:
    data = pa.table(table).select(COLUMNS).to_pylist()
    return sorted(tuple(row[c] for c in COLUMNS) for row in data)


def _deletion_vectors_in_log(path: str) -> int:
    """How many files the table's log added with a deletion vector (rows marked deleted, not rewritten)."""
    count = 0
    for commit in sorted((Path(path) / "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            add = json.loads(line).get("add")
            count += bool(add and add.get("deletionVector"))
    return count


def test_deltalake_reads_a_table_with_and_without_deletion_vectors(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topics = {"open": topic_factory(partitions=2), "marked": topic_factory(partitions=2)}
    tables = {
        name: {
            "topic": topic,
            "keys": ["order_id"],
            "sequence_by": "seq",
            "schema": "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms BIGINT",
            "deletion_vectors": name == "marked",
        }
        for name, topic in topics.items()
    }
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "engines", tables, max_offsets_per_trigger=150)
    flipped = {**tables, "open": {**tables["open"], "deletion_vectors": True}}
    log: list[LoggedChange] = []
    rounds = [
        [upsert(k, 1, "new", amount=k * 1.5) for k in range(200)],
        [upsert(k, 2, "paid", amount=k * 2.0) for k in range(0, 200, 3)] + [delete(k, 3) for k in range(1, 200, 7)],
    ]
    # Every MERGE writes deletion vectors where the table has them (these tables are far below the size where
    # the replica would choose them), so that the marked table's files carry some.
    monkeypatch.setattr(merge, "REWRITE_MAX_BYTES", 0)
    for changes in rounds:  # the second round updates rows that earlier commits wrote
        for name, topic in topics.items():
            log += produce(connection, topic, changes, table=name)
        run_available_now(spark, cfg)

    for name in topics:
        assert_matches_model(spark, cfg, [e for e in log if e.table == name], table=name)
    open_path, marked_path = (str(cfg.table(name).target.path) for name in topics)
    assert _deletion_vectors_in_log(marked_path) > 0
    assert _deletion_vectors_in_log(open_path) == 0

    opened = DeltaTable(open_path)
    assert "deletionVectors" not in (opened.protocol().reader_features or [])
    assert _rows(opened.to_pyarrow_table(columns=COLUMNS)) == _model(log, "open")

    marked = DeltaTable(marked_path)
    assert "deletionVectors" in (marked.protocol().reader_features or [])
    result = QueryBuilder().register("t", marked).execute(f"SELECT {', '.join(COLUMNS)} FROM t").read_all()
    assert _rows(result) == _model(log, "marked")
    with pytest.raises(DeltaProtocolError, match="deletionVectors"):  # what the README tells pyarrow users
        marked.to_pyarrow_table()

    # The setting is the table's promise to its readers: a config that no longer says what the table is stops.
    with pytest.raises(ConfigError) as refused:
        ensure_replica_tables(spark, replica_config(tmp_path, connection["bootstrap.servers"], "engines", flipped))
    assert refused.value.key == "deletion_vectors"
    assert "SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')" in refused.value.fix
