"""The state of a merge-on-read table in SQL: the order in which a query of it reads the three tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession

from replica_dev.conf import orders_table, replica_doc
from replica_lib.config import MERGE_ON_READ, parse_replica
from replica_lib.layout import state_sql
from replica_lib.target import table_schema


@pytest.mark.parametrize("whole", [False, True])
def test_a_query_of_the_state_takes_the_change_logs_snapshot_before_the_other_tables(
    spark: SparkSession, tmp_path: Path, whole: bool
) -> None:
    """A fold writes the base and the retained deletes before it retires the changes it applied: a reader that
    takes the change log's snapshot first finds every change in one of its reads. The catalog's view cannot pin
    the change log's version, so the order in which Spark resolves the query's tables is what keeps it exact:
    with none of the three tables there, the one Spark fails on first is the one it resolves first."""
    doc = replica_doc("shop", tmp_path, "b:9092", {"lines": orders_table("l", layout=MERGE_ON_READ)})
    cfg = parse_replica(doc, "shop.toml", {})
    schema = table_schema(cfg.table("lines"), cfg.source_file)
    paths = {name: tmp_path / "absent" / name for name in ("base", "changes", "deletes")}
    state = state_sql(schema, *(f"delta.`{paths[name]}`" for name in ("base", "changes", "deletes")), whole=whole)
    columns = ", ".join(f"`{f.name}`" for f in schema.kept.fields)
    for query in (state, f"SELECT {columns} FROM ({state}) AS state"):  # as itself, and as the catalog's view
        with pytest.raises(AnalysisException) as failed:
            spark.sql(query)
        named = [name for name, path in paths.items() if str(path) in str(failed.value)]
        assert named == ["changes"], str(failed.value).splitlines()[0]
