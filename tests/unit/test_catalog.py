"""A replica's catalog names, from its file alone (no JVM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from replica_dev.conf import orders_table, replica_doc
from replica_lib.catalog import entries
from replica_lib.config import ReplicaConfig, parse_replica
from replica_lib.errors import ConfigError
from replica_lib.layout import state_sql
from replica_lib.target import table_schema


def _config(tmp_path: Path, **tables: dict[str, object]) -> ReplicaConfig:
    doc = replica_doc("shop", tmp_path, "b:9092", tables, replica={"metrics": {"path": str(tmp_path / "_metrics")}})
    return parse_replica(doc, "shop.toml", {})


def test_each_table_has_its_state_raw_table_and_deletes_and_the_replica_its_quarantine_and_metrics(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path, orders=orders_table("o"), lines=orders_table("l", layout="merge-on-read"))
    found = {entry.name: entry for entry in entries(cfg)}
    assert list(found) == [
        "orders__raw",
        "orders__deletes",
        "orders",
        "lines__raw",
        "lines__deletes",
        "lines__changes",
        "lines",
        "quarantine",
        "metrics",
    ]
    assert {e.database for e in found.values()} == {"shop"}
    assert found["orders__raw"].location == str(tmp_path / "orders")
    assert found["orders__deletes"].location == str(tmp_path / "orders") + "__tombstones"
    assert found["lines__changes"].location == str(tmp_path / "lines") + "__changes"
    assert found["quarantine"].location == str(tmp_path / "_quarantine")
    # The state shows the user's columns only, read from the raw table (merge-on-read: ranked with its changes).
    columns = "`order_id`, `customer`, `amount`, `status`, `updated_ms`"
    assert found["orders"].query == f"SELECT {columns} FROM `shop`.`orders__raw`"
    assert found["orders"].needs == ("orders__raw",)
    tables = (f"`shop`.`lines__{name}`" for name in ("raw", "changes", "deletes"))
    state = state_sql(table_schema(cfg.table("lines"), cfg.source_file), *tables)
    assert found["lines"].query == f"SELECT {columns} FROM ({state}) AS state"
    assert found["lines"].needs == ("lines__raw", "lines__changes", "lines__deletes")


def test_a_target_in_the_catalog_is_read_through_a_view_of_its_name(tmp_path: Path) -> None:
    cfg = _config(tmp_path, orders=orders_table("o", target={"table": "sales.orders"}))
    found = {entry.name: entry for entry in entries(cfg)}
    assert (found["orders__raw"].query, found["orders__raw"].source) == ("SELECT * FROM sales.orders", "sales.orders")
    assert found["orders__deletes"].source == "sales.orders__tombstones"


@pytest.mark.parametrize("name", ["quarantine", "orders__raw"])
def test_a_table_named_like_another_name_of_the_replica_is_refused(tmp_path: Path, name: str) -> None:
    cfg = _config(tmp_path, orders=orders_table("o"), **{name: orders_table("x")})
    with pytest.raises(ConfigError) as caught:
        entries(cfg)
    assert f"shop.toml: tables.{name}: catalog name shop.{name} would be used twice" in str(caught.value)
