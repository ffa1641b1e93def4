"""Checks a replica file gets when it is loaded, before any broker call or table: schemas, keys, locations, topics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from replica_dev.conf import ORDERS_SCHEMA
from replica_lib.config import DdlError, Target, load_replica, load_replicas, parse_replica, parse_schema, schema_json
from replica_lib.errors import ConfigError

SOURCE = "checks.toml"


def doc_with(**table: Any) -> dict[str, Any]:
    """A valid one-table replica document, with ``table``'s keys overriding the orders table's."""
    return {
        "replica": {"name": "r1", "checkpoint": "/data/r1/_checkpoint", "quarantine": {"path": "/data/r1/_q"}},
        "kafka": {"bootstrap_servers": "b:9092"},
        "tables": {
            "orders": {
                "topic": "orders",
                "keys": ["order_id"],
                "schema": ORDERS_SCHEMA,
                "target": {"path": "/data/r1/orders"},
                **table,
            }
        },
    }


def refused(doc: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_replica(doc, SOURCE, {})
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"{SOURCE}: {info.value.key}: ")
    return info.value


# ---------------------------------------------------------------------------------------------- DDL
SPARK_DDLS = [
    ORDERS_SCHEMA,
    "a INT, b STRING NOT NULL, c DECIMAL(12, 2) COMMENT 'money', d DATE, e TIMESTAMP, f TIMESTAMP_NTZ",
    "a: byte, b: short, c: long, d: float, e: double, f: boolean, g: binary",
    "a TINYINT, b SMALLINT, c INTEGER, d REAL, e DEC, f NUMERIC(5), g TIMESTAMP_LTZ",
    "`odd.name` STRING, `$x-y` INT, `é[0]` STRUCT<`a.b`: INT>",
    "a ARRAY<STRUCT<x: INT, y STRING NOT NULL>>, m MAP<STRING, ARRAY<BIGINT>>, s STRUCT<>",
    "c string, `m`: MAP<STRING, STRUCT<k: MAP<string, int>>>",
]


@pytest.mark.parametrize("ddl", SPARK_DDLS)
def test_the_schema_reading_equals_sparks_own(spark: SparkSession, ddl: str) -> None:
    assert T.StructType.fromJson(schema_json(ddl)) == T.DataType.fromDDL(ddl)


@pytest.mark.parametrize(
    ("ddl", "says"),
    [
        ("", "no columns"),
        ("a INT,", "expected a column name at the end"),
        ("a INTT", "type 'INTT' (character 3) is not supported"),
        ("a ARRAY<INT", "expected '>' closing ARRAY<"),
        ("a MAP<STRING>", "expected ',' between MAP's key and value types"),
        ("a DECIMAL(40, 2)", "precision must be 1 to 38"),
        ("a INT b STRING", "expected ',' or the end at 'b'"),
        ("a INTERVAL DAY", "type 'INTERVAL' (character 3) is not supported"),
        ("a INT; DROP", "unexpected ';' at character 6"),
        ("a CHAR(3)", "type 'CHAR' (character 3) is not supported: declare the column STRING"),
        ("a INT, b VARCHAR(10)", "type 'VARCHAR' (character 10) is not supported: declare the column STRING"),
        ("m MAP<INT, STRING>", "MAP's key type at 'INT' (character 7) must be STRING"),
        ("a INT, `it's` STRING", 'the name "it\'s" (character 8) holds "\'", which a JSON path'),
        ("s STRUCT<`o'k`: INT>", 'the name "o\'k" (character 10) holds "\'"'),
        ("`a b` STRING", "the name 'a b' (character 1) holds ' ', which Delta refuses in a column name"),
        ("s STRUCT<`x=1`: INT>", "the name 'x=1' (character 10) holds '=', which Delta refuses"),
        ("`x``y` STRING", "the name 'x`y' (character 1) holds '`', which the replica's SQL cannot quote"),
        ("a ARRAY<MAP<DATE, INT>>", "MAP's key type at 'DATE' (character 13) must be STRING"),
    ],
)
def test_a_bad_schema_says_where(ddl: str, says: str) -> None:
    with pytest.raises(DdlError) as info:
        parse_schema(ddl)
    assert says in str(info.value)


def test_a_schema_spark_cannot_read_from_json_is_refused_at_load() -> None:
    """Spark's JSON reader refuses CHAR, VARCHAR and MAP keys other than STRING when the job plans its first batch:
    the file is refused before, naming the field and the fix."""
    for schema, says in (
        ("order_id BIGINT, tags MAP<BIGINT, STRING>", "MAP<STRING, ...>"),
        ("order_id BIGINT, code CHAR(2)", "declare the column STRING"),
    ):
        err = refused(doc_with(schema=schema))
        assert err.key == "tables.orders.schema"
        assert says in err.problem


def test_a_schema_typo_names_the_table_and_field() -> None:
    err = refused(doc_with(schema="order_id BIGINT, status STRNG"))
    assert err.key == "tables.orders.schema"
    assert "'STRNG'" in err.problem


@pytest.mark.parametrize(
    ("table", "key", "says"),
    [
        ({"schema": "order_id BIGINT, _src_offset BIGINT"}, "tables.orders.schema", "reserved _src_ prefix"),
        ({"schema": "order_id BIGINT, Status STRING, status STRING"}, "tables.orders.schema", "declared twice"),
        (
            {"schema": "order_id BIGINT, a ARRAY<STRUCT<s: STRUCT<x: INT NOT NULL>>>"},
            "tables.orders.schema",
            "column a has a field x declared NOT NULL inside it",
        ),
        ({"keys": ["id"]}, "tables.orders.keys", "id is not a column of the schema"),
        ({"keys": ["order_id", "order_id"]}, "tables.orders.keys", "lists a column twice"),
        ({"keys": ["amount"]}, "tables.orders.keys", "key column amount has type double"),
        ({"schema": "order_id MAP<STRING, INT>"}, "tables.orders.keys", "has type map<string,integer>"),
        ({"include_columns": ["nope"]}, "tables.orders.include_columns", "nope is not a column"),
        ({"exclude_columns": ["order_id"]}, "tables.orders.exclude_columns", "order_id is a key column"),
        ({"sequence_by": "version"}, "tables.orders.sequence_by", "neither the envelope's seq nor a column"),
        ({"sequence_by": "status"}, "tables.orders.sequence_by", "column status has type string"),
        ({"format": "debezium", "sequence_by": "source lsn"}, "tables.orders.sequence_by", "field path"),
    ],
)
def test_keys_sequence_and_column_lists_are_checked_at_load(table: dict[str, Any], key: str, says: str) -> None:
    err = refused(doc_with(**table))
    assert err.key == key
    assert says in err.problem


@pytest.mark.parametrize(
    "table",
    [
        {"sequence_by": "seq"},
        {"sequence_by": "updated_ms"},
        {"format": "debezium", "sequence_by": "source.lsn"},
        {"schema": "order_id DECIMAL(12,2), day DATE, v INT", "keys": ["order_id", "day"], "sequence_by": "v"},
        {"schema": "order_id STRING, customer STRING", "include_columns": ["customer"]},
    ],
)
def test_valid_tables_load(table: dict[str, Any]) -> None:
    assert parse_replica(doc_with(**table), SOURCE, {}).tables[0].name == "orders"


# ---------------------------------------------------------------------------------------------- locations
def with_second_table(**second: Any) -> dict[str, Any]:
    doc = doc_with()
    doc["tables"]["lines"] = {
        "topic": "orders",
        "keys": ["order_id"],
        "schema": "order_id BIGINT, sku STRING",
        "target": {"path": "/data/r1/lines"},
        **second,
    }
    return doc


@pytest.mark.parametrize(
    ("doc", "key", "says"),
    [
        (with_second_table(target={"path": "/data/r1/orders/"}), "tables.lines.target", "share a location"),
        (with_second_table(target={"path": "/data/r1/orders__tombstones"}), "tables.lines.target", "retained"),
        (with_second_table(target={"path": "/data/r1/orders/lines"}), "tables.lines.target", "share a location"),
    ],
)
def test_tables_need_places_of_their_own(doc: dict[str, Any], key: str, says: str) -> None:
    err = refused(doc)
    assert err.key == key
    assert says in err.problem


def test_catalog_tables_collide_by_name_and_by_derived_tombstones() -> None:
    doc = doc_with(target={"table": "db.orders"})
    doc["tables"]["lines"] = {**doc["tables"]["orders"], "target": {"table": "DB.orders__tombstones"}}
    err = refused(doc)
    assert (err.key, "the retained deletes of orders" in err.problem) == ("tables.lines.target", True)


@pytest.mark.parametrize("quarantine", ["/data/r1/orders", "/data/r1/orders/_q", "/data/r1/orders__tombstones"])
def test_the_quarantine_is_apart_from_every_table(quarantine: str) -> None:
    doc = doc_with()
    doc["replica"]["quarantine"] = {"path": quarantine}
    err = refused(doc)
    assert err.key == "replica.quarantine"
    assert "the quarantine table and" in err.problem


@pytest.mark.parametrize("metrics", ["/data/r1/orders", "/data/r1/orders__tombstones/m", "/data/r1/_quarantine"])
def test_the_metrics_table_is_apart_from_every_other(metrics: str) -> None:
    doc = doc_with()
    doc["replica"]["quarantine"] = {"path": "/data/r1/_quarantine"}
    doc["replica"]["metrics"] = {"path": metrics}
    err = refused(doc)
    assert err.key == "replica.metrics"
    assert "the metrics table and" in err.problem


def test_a_metrics_table_of_its_own_loads() -> None:
    doc = doc_with()
    doc["replica"]["metrics"] = {"table": "ops.replica_metrics"}
    assert parse_replica(doc, SOURCE, {}).metrics == Target(table="ops.replica_metrics")


@pytest.mark.parametrize("checkpoint", ["/data/r1/orders", "/data/r1/orders/_checkpoint", "/data/r1", "file:/data"])
def test_the_checkpoint_is_apart_from_every_table(checkpoint: str) -> None:
    doc = doc_with()
    doc["replica"]["checkpoint"] = checkpoint
    err = refused(doc)
    assert err.key == "replica.checkpoint"
    assert "overlaps the location of" in err.problem


# ---------------------------------------------------------------------------------------------- topics
def test_tables_of_one_topic_share_its_format() -> None:
    err = refused(with_second_table(format="debezium"))
    assert err.key == "tables.lines.format"
    assert "topic orders feeds tables of different formats (debezium, native)" in err.problem


def test_a_debezium_topic_feeds_one_table() -> None:
    doc = with_second_table(format="debezium")
    doc["tables"]["orders"]["format"] = "debezium"
    err = refused(doc)
    assert err.key == "tables.lines.topic"
    assert "Debezium topic orders feeds 2 tables (orders, lines)" in err.problem


def test_native_tables_may_share_a_topic() -> None:
    assert [t.name for t in parse_replica(with_second_table(), SOURCE, {}).tables] == ["orders", "lines"]


# ---------------------------------------------------------------------------------------------- several files
def write(tmp_path: Path, name: str, checkpoint: str, table: str, replica: str | None = None) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'[replica]\nname = "{replica or name}"\ncheckpoint = "{checkpoint}"\n'
        f'quarantine = {{ path = "/data/{name}/_q" }}\n'
        '[kafka]\nbootstrap_servers = "b:9092"\n'
        f'[tables.orders]\ntopic = "orders"\nkeys = ["order_id"]\nschema = "{ORDERS_SCHEMA}"\n'
        f'target = {{ path = "{table}" }}\n'
    )
    return path


def test_files_run_together_need_their_own_checkpoints_tables_and_names(tmp_path: Path) -> None:
    a = write(tmp_path, "a", "/data/a/_cp", "/data/a/orders")
    ok = write(tmp_path, "b", "/data/b/_cp", "/data/b/orders")
    assert [c.name for c in load_replicas([a, ok])] == ["a", "b"]
    cases = [
        (write(tmp_path, "c", "/data/a/_cp", "/data/c/orders"), "replica.checkpoint", "its checkpoint"),
        (write(tmp_path, "d", "/data/a/_cp/inner", "/data/d/orders"), "replica.checkpoint", "its checkpoint"),
        (write(tmp_path, "e", "/data/e/_cp", "/data/a/orders"), "tables.orders.target", "table orders of replica a"),
        (write(tmp_path, "f", "/data/a/orders/_cp", "/data/f/orders"), "replica.checkpoint", "table orders"),
        (write(tmp_path, "g", "/data/g/_cp", "/data/g/orders", replica="a"), "replica.name", "also the name"),
    ]
    for path, key, says in cases:
        with pytest.raises(ConfigError) as info:
            load_replicas([a, path])
        assert (info.value.source, info.value.key) == (str(path), key)
        assert says in info.value.problem


def test_a_schema_typo_fails_at_load_in_under_a_second_with_no_broker(tmp_path: Path) -> None:
    """No broker answers at this address: the typo is reported at once, naming the field, not as a broker error."""
    path = tmp_path / "typo.toml"
    path.write_text(
        '[replica]\nname = "typo"\ncheckpoint = "/data/typo/_cp"\nquarantine = { path = "/data/typo/_q" }\n'
        '[kafka]\nbootstrap_servers = "127.0.0.1:1"\n'
        '[tables.orders]\ntopic = "orders"\nkeys = ["order_id"]\n'
        'schema = "order_id BIGINT, status STRIGN"\ntarget = { path = "/data/typo/orders" }\n'
    )
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_replica(path, {})
    assert time.monotonic() - started < 1.0
    assert info.value.key == "tables.orders.schema"
    assert "'STRIGN'" in str(info.value)
