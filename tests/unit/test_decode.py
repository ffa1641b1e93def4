"""replica_lib.decode: raw Kafka records -> typed change rows, with a reason for every broken record."""

from __future__ import annotations

import base64
import json
import re
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_lib import decode, logical
from replica_lib.config import ReplicaConfig, parse_replica
from replica_lib.producer import Change, encode_key, encode_value
from replica_lib.target import TableSchema, table_schema

# The decode's expressions run as in a replica job: with Spark's code generation (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("production_codegen")

RAW_SCHEMA = "key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP"
ORDERS_SCHEMA = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms BIGINT"
KAFKA_TS = datetime(2024, 1, 2, 3, 4, 5)
TS_MS = 1_700_000_000_000
RawRow = tuple[bytearray | None, bytearray | None, str, int, int, datetime]

#: Columns every change row carries after the table's own columns.
CHANGE_TAIL = ["_op", "_seq", "_tombstone", "_topic", "_partition", "_offset", "_event_ts", "_kafka_ts"]
CHANGE_TAIL += ["_key", "_value", "_table", "_error", "_row", "_connect_fields"]
#: What the typed-row comparisons look at (event time as epoch millis, so no time zone is involved).
META = ("_op", "_seq", "_tombstone", "_topic", "_partition", "_offset", "_event_ms")
META_DDL = "_op STRING, _seq BIGINT, _tombstone BOOLEAN, _topic STRING, _partition INT, _offset BIGINT"
META_DDL += ", _event_ms BIGINT"


def js(obj: Any) -> bytearray:
    return bytearray(json.dumps(obj).encode())


def record(key: Any, value: Any, offset: int, topic: str = "orders", partition: int = 0) -> RawRow:
    """A raw Kafka record; ``key``/``value`` are JSON-encoded unless given as bytes (or None)."""
    as_bytes = [v if v is None or isinstance(v, bytes) else bytes(js(v)) for v in (key, value)]
    k, v = (None if b is None else bytearray(b) for b in as_bytes)
    return (k, v, topic, partition, offset, KAFKA_TS)


def replica(tables: dict[str, dict[str, Any]]) -> ReplicaConfig:
    doc = {
        "replica": {"name": "unit", "checkpoint": "/unused/cp", "quarantine": {"path": "/unused/q"}},
        "kafka": {"bootstrap_servers": "unused:9092"},
        "tables": {name: {"target": {"path": f"/unused/{name}"}, **spec} for name, spec in tables.items()},
    }
    return parse_replica(doc, "test.toml", {})


def schemas_of(cfg: ReplicaConfig) -> dict[str, TableSchema]:
    return {table.name: table_schema(table, "test.toml") for table in cfg.tables}


def decode_table(
    spark: SparkSession, cfg: ReplicaConfig, rows: list[RawRow], table: str, unrouted: bool = False
) -> DataFrame:
    schemas = schemas_of(cfg)
    env_df = decode.envelopes(spark.createDataFrame(rows, RAW_SCHEMA), cfg, schemas)
    # Materialized, as the batch handler does: every assertion then reads rows instead of planning and compiling
    # the decoding expressions again under its own filter (tens of seconds each).
    return decode.table_changes(env_df, schemas[table], unrouted=unrouted).localCheckpoint()


def typed(df: DataFrame, *columns: str) -> DataFrame:
    """The valid rows of ``df``: ``columns`` then the change metadata in :data:`META`."""
    return decode.valid(df).withColumn("_event_ms", F.unix_millis("_event_ts")).select(*columns, *META)


def errors(df: DataFrame) -> list[tuple[int, str]]:
    return sorted((row["_offset"], row["_error"]) for row in decode.rejected(df).select("_offset", "_error").collect())


def offsets(df: DataFrame) -> list[int]:
    return sorted(row["_offset"] for row in df.select("_offset").collect())


ORDERS = {"topic": "orders", "keys": ["order_id"], "sequence_by": "seq", "schema": ORDERS_SCHEMA}
NOT_JSON = "not valid JSON (NaN, Infinity, single quotes, comments and leading zeros are not JSON)"


def order(
    order_id: int,
    customer: str | None,
    amount: float | str | None,
    status: str | None,
    updated_ms: int | None,
) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "customer": customer,
        "amount": amount,
        "status": status,
        "updated_ms": updated_ms,
    }


# ---------------------------------------------------------------------------------------------- native format
def test_native_upserts_deletes_and_tombstones_decode_into_typed_rows(spark: SparkSession) -> None:
    cfg = replica({"orders": ORDERS})
    first = {"op": "upsert", "seq": 1, "ts_ms": TS_MS, "data": order(1, "ada", 10.5, "new", 1000)}
    rows = [
        record({"order_id": 1}, first, 0),
        record({"order_id": 1}, {"op": "upsert", "seq": 2, "data": order(1, None, 12.0, "paid", None)}, 1),
        record({"order_id": 1}, first, 2),  # the same change again, at another offset
        record({"order_id": 1}, {"op": "delete", "seq": 3, "ts_ms": TS_MS + 5}, 3),
        record({"order_id": 2}, {"op": "delete", "seq": 9, "data": None}, 4),
        record({"order_id": 2}, None, 5, partition=1),  # a Kafka tombstone: no seq needed
        record({"order_id": 3}, {"op": "upsert", "seq": 1, "table": "orders", "data": {"order_id": 3}}, 6),
    ]
    changes_df = decode_table(spark, cfg, rows, "orders")

    assert changes_df.columns == ["order_id", "customer", "amount", "status", "updated_ms", *CHANGE_TAIL]
    assert errors(changes_df) == []
    expected_df = spark.createDataFrame(
        [
            (1, "ada", 10.5, "new", 1000, "upsert", 1, False, "orders", 0, 0, TS_MS),
            (1, None, 12.0, "paid", None, "upsert", 2, False, "orders", 0, 1, None),
            (1, "ada", 10.5, "new", 1000, "upsert", 1, False, "orders", 0, 2, TS_MS),
            (1, None, None, None, None, "delete", 3, False, "orders", 0, 3, TS_MS + 5),
            (2, None, None, None, None, "delete", 9, False, "orders", 0, 4, None),
            (2, None, None, None, None, "delete", None, True, "orders", 1, 5, None),
            (3, None, None, None, None, "upsert", 1, False, "orders", 0, 6, None),
        ],
        f"{ORDERS_SCHEMA}, {META_DDL}",
    )
    actual_df = typed(changes_df, "order_id", "customer", "amount", "status", "updated_ms")
    assert_df_equality(actual_df, expected_df, ignore_row_order=True, ignore_nullable=True)

    # The raw bytes are kept for quarantine only: a valid change no longer carries them.
    raw = changes_df.where(F.col("_offset").isin(0, 5)).orderBy("_offset").collect()
    assert [(r["_key"], r["_value"], r["_kafka_ts"], r["_table"]) for r in raw] == [
        (None, None, KAFKA_TS, "orders"),
        (None, None, KAFKA_TS, "orders"),
    ]


def test_the_streams_decode_keeps_every_record_and_is_the_batchs_without_the_bytes(spark: SparkSession) -> None:
    # A replica of one table decodes in its query's plan (decode.stream_changes), every raw record kept: the
    # handler drops a valid change's bytes as the batch's decode does, and decodes the records again from them.
    cfg = replica({"orders": ORDERS})
    schemas = schemas_of(cfg)
    rows = [
        record({"order_id": 1}, {"op": "upsert", "seq": 1, "data": order(1, "ada", 10.5, "new", 1000)}, 0),
        record({"order_id": 1}, {"op": "delete", "seq": 2}, 1),
        record({"order_id": 2}, None, 2),
        record({"order_id": 3}, b"not json", 3),
        record(None, {"op": "upsert", "seq": 1, "data": order(4, "bo", 1.0, "new", 1)}, 4, partition=1),
        record({"order_id": 5}, {"op": "upsert", "seq": 1, "table": "elsewhere", "data": {"order_id": 5}}, 5),
    ]
    raw_df = spark.createDataFrame(rows, RAW_SCHEMA)
    streamed = decode.stream_changes(raw_df, cfg, schemas)
    assert streamed is not None
    streamed = streamed.localCheckpoint()
    assert_df_equality(
        decode.records(streamed), raw_df, ignore_row_order=True, ignore_column_order=True, ignore_nullable=True
    )
    batch_df = decode.table_changes(decode.envelopes(raw_df, cfg, schemas), schemas["orders"], True, True)
    comparable = [c for c in batch_df.columns if c != decode.ROW]
    assert_df_equality(
        decode.without_valid_raw(streamed).select(comparable),
        batch_df.select(comparable),
        ignore_row_order=True,
        ignore_nullable=True,
    )
    assert sorted(offsets(decode.rejected(streamed))) == [3, 4, 5]

    two = replica({"orders": ORDERS, "payments": {"topic": "orders", "keys": ["id"], "schema": "id BIGINT"}})
    assert decode.stream_changes(raw_df, two, schemas_of(two)) is None  # decoded per table, in the batch


def test_native_contract_violations_are_rejected_with_a_reason(spark: SparkSession) -> None:
    cfg = replica({"orders": ORDERS})
    ok = {"op": "upsert", "seq": 1, "data": order(1, "ada", 1.0, "new", 1)}
    rows = [
        record({"order_id": 1}, ok, 0),
        record({"order_id": 1}, b'{"op": "upsert", "seq": ', 1),
        record({"order_id": 1}, [ok], 2),
        record({"order_id": 1}, {"op": "merge", "seq": 2, "data": order(1, "ada", 1.0, "new", 1)}, 3),
        record({"order_id": 1}, {"seq": 2, "data": order(1, "ada", 1.0, "new", 1)}, 4),
        record(None, ok, 5),
        record(None, None, 6),  # a tombstone without a key
        record(b"order-1", ok, 7),
        record({"id": 1}, ok, 8),
        record({"order_id": "one"}, ok, 9),
        record({"order_id": 1}, {"op": "upsert", "seq": 2, "data": order(1, "ada", "abc", "new", 1)}, 10),
        record({"order_id": 1}, {"op": "upsert", "seq": 2}, 11),
        record({"order_id": 1}, {"op": "upsert", "seq": 2, "data": None}, 12),
        record({"order_id": 5}, {"op": "upsert", "seq": 2, "data": order(6, "ada", 1.0, "new", 1)}, 13),
        record({"order_id": 1}, {"op": "upsert", "data": order(1, "ada", 1.0, "new", 1)}, 14),
        record({"order_id": 1}, {"op": "delete"}, 15),
        record({"order_id": 1}, None, 16),  # a tombstone without seq is fine on a sequenced table
        record({"order_id": 1}, {"op": "upsert", "seq": "two", "data": order(1, "ada", 1.0, "new", 1)}, 17),
        record({"order_id": 1}, {"op": "upsert", "seq": 2, "data": 7}, 18),
        record({"order_id": 1}, {"op": "upsert", "seq": 2, "data": {"customer": "ada"}}, 19),
        record({"order_id": 1}, b"", 20),
        record({"order_id": 1}, b"null", 21),
    ]
    changes_df = decode_table(spark, cfg, rows, "orders")

    wrong_type = "envelope has a field of the wrong type (op and table are strings, seq and ts_ms integers)"
    mismatch = "the record key does not match the key columns in data"
    assert errors(changes_df) == [
        (1, f"value is not a JSON object: {NOT_JSON}"),
        (2, "value is not a JSON object"),
        (3, "unknown op 'merge' (expected upsert or delete)"),
        (4, "missing op"),
        (5, "missing key: the Kafka record key is null"),
        (6, "missing key: the Kafka record key is null"),
        (7, f"key is not a JSON object of the key columns (order_id): {NOT_JSON}"),
        (8, "key lacks a key column (order_id)"),
        (9, "key has a column of the wrong type (expected order_id bigint)"),
        (10, "data does not match the table schema: amount (double)"),
        (11, "upsert without data"),
        (12, "upsert without data"),
        (13, mismatch),
        (14, "missing sequence: table orders is ordered by seq"),
        (15, "missing sequence: table orders is ordered by seq"),
        (17, wrong_type),
        (18, "data is not a JSON object of the table's columns"),
        (19, mismatch),
        (20, "value is empty (zero bytes)"),
        (21, "value is not a JSON object"),
    ]
    assert offsets(decode.valid(changes_df)) == [0, 16]
    assert changes_df.count() == len(rows)  # every record is either valid or rejected, none is lost
    kept = changes_df.where(F.col("_offset").isin(1, 5, 6)).orderBy("_offset").collect()
    assert [(r["_key"], r["_value"]) for r in kept] == [  # a rejected record keeps its raw bytes, nulls and all
        (js({"order_id": 1}), bytearray(b'{"op": "upsert", "seq": ')),
        (None, js(ok)),
        (None, None),
    ]


def test_sequence_column_from_data_and_kept_columns(spark: SparkSession) -> None:
    cfg = replica(
        {
            "orders": {**ORDERS, "sequence_by": "updated_ms", "exclude_columns": ["customer"]},
            "slim": {
                "topic": "slim",
                "keys": ["order_id"],
                "schema": ORDERS_SCHEMA,
                "include_columns": ["status"],
            },
        }
    )
    rows = [
        record({"order_id": 1}, {"op": "upsert", "seq": 99, "data": order(1, "ada", 2.5, "new", 70)}, 0),
        record({"order_id": 1}, {"op": "upsert", "seq": 99, "data": order(1, "ada", 2.5, "new", None)}, 1),
        record({"order_id": 1}, {"op": "delete", "seq": 71}, 2),
        record({"order_id": 4}, {"op": "upsert", "data": order(4, "bob", 1.0, "paid", 5)}, 0, topic="slim"),
        record({"order_id": 4}, None, 1, topic="slim"),
    ]
    orders_df = decode_table(spark, cfg, rows, "orders")
    slim_df = decode_table(spark, cfg, rows, "slim")

    assert orders_df.columns == ["order_id", "amount", "status", "updated_ms", *CHANGE_TAIL]
    assert slim_df.columns == ["order_id", "status", *CHANGE_TAIL]
    assert errors(orders_df) == [(1, "missing sequence: table orders is ordered by updated_ms")]
    assert errors(slim_df) == []
    assert_df_equality(
        typed(orders_df, "order_id", "amount", "status", "updated_ms"),
        spark.createDataFrame(
            [
                (1, 2.5, "new", 70, "upsert", 70, False, "orders", 0, 0, None),
                (1, None, None, None, "delete", 71, False, "orders", 0, 2, None),
            ],
            f"order_id BIGINT, amount DOUBLE, status STRING, updated_ms BIGINT, {META_DDL}",
        ),
        ignore_row_order=True,
        ignore_nullable=True,
    )
    assert_df_equality(
        typed(slim_df, "order_id", "status"),
        spark.createDataFrame(
            [
                (4, "paid", "upsert", None, False, "slim", 0, 0, None),
                (4, None, "delete", None, True, "slim", 0, 1, None),
            ],
            f"order_id BIGINT, status STRING, {META_DDL}",
        ),
        ignore_row_order=True,
        ignore_nullable=True,
    )


def test_a_topic_with_several_tables_routes_by_the_table_field(spark: SparkSession) -> None:
    cfg = replica(
        {
            "customers": {
                "topic": "shop",
                "keys": ["customer_id"],
                "schema": "customer_id BIGINT, name STRING",
            },
            "payments": {
                "topic": "shop",
                "keys": ["payment_id"],
                "sequence_by": "seq",
                "schema": "payment_id BIGINT, amount DOUBLE",
            },
        }
    )
    rows = [
        record(
            {"customer_id": 7},
            {"op": "upsert", "table": "customers", "data": {"customer_id": 7, "name": "ada"}},
            0,
            topic="shop",
        ),
        record(
            {"payment_id": 7},
            {"op": "upsert", "table": "payments", "seq": 1, "data": {"payment_id": 7, "amount": 9.5}},
            1,
            topic="shop",
        ),
        record(
            {"payment_id": 8},
            {"op": "upsert", "table": "refunds", "seq": 1, "data": {"payment_id": 8, "amount": 1.0}},
            2,
            topic="shop",
        ),
        record(
            {"payment_id": 8},
            {"op": "upsert", "seq": 1, "data": {"payment_id": 8, "amount": 1.0}},
            3,
            topic="shop",
        ),
        record({"payment_id": 7}, None, 4, topic="shop"),
        record({"payment_id": 7}, {"op": "delete", "table": "payments", "seq": 2}, 5, topic="shop"),
        record({"customer_id": 7}, {"op": "delete", "table": "customers"}, 6, topic="shop"),
        record(
            {"customer_id": 7},
            {"op": "upsert", "table": "customers", "data": {"customer_id": "7", "name": "x"}},
            7,
            topic="shop",
        ),
    ]
    schemas = schemas_of(cfg)
    env_df = decode.envelopes(spark.createDataFrame(rows, RAW_SCHEMA), cfg, schemas)
    routed = sorted((r["_offset"], r["_table"], r["_error"]) for r in env_df.collect())
    assert routed == [
        (0, "customers", None),
        (1, "payments", None),
        (2, None, "unknown table 'refunds' (this topic carries: customers, payments)"),
        (3, None, "no table field on a topic that carries several tables (customers, payments)"),
        (
            4,
            None,
            "a tombstone on a topic that carries several tables cannot name its table; "
            "send op=delete with a table field instead",
        ),
        (5, "payments", None),
        (6, "customers", None),
        (7, "customers", None),
    ]

    assert offsets(decode.rejected(env_df)) == [2, 3, 4]
    assert offsets(decode.valid(env_df)) == [0, 1, 5, 6, 7]

    customers_df = decode.table_changes(env_df, schemas["customers"]).localCheckpoint()
    payments_df = decode.table_changes(env_df, schemas["payments"]).localCheckpoint()
    assert errors(customers_df) == [(7, "data does not match the table schema: customer_id (bigint)")]
    assert errors(payments_df) == []
    assert_df_equality(
        typed(customers_df, "customer_id", "name"),
        spark.createDataFrame(
            [
                (7, "ada", "upsert", None, False, "shop", 0, 0, None),
                (7, None, "delete", None, False, "shop", 0, 6, None),
            ],
            f"customer_id BIGINT, name STRING, {META_DDL}",
        ),
        ignore_row_order=True,
        ignore_nullable=True,
    )
    assert_df_equality(
        typed(payments_df, "payment_id", "amount"),
        spark.createDataFrame(
            [
                (7, 9.5, "upsert", 1, False, "shop", 0, 1, None),
                (7, None, "delete", 2, False, "shop", 0, 5, None),
            ],
            f"payment_id BIGINT, amount DOUBLE, {META_DDL}",
        ),
        ignore_row_order=True,
        ignore_nullable=True,
    )


# ---------------------------------------------------------------------------------------------- Debezium
PRODUCTS = {
    "topic": "dbz",
    "format": "debezium",
    "keys": ["id"],
    "schema": "id BIGINT, name STRING, price DOUBLE",
}


def dbz(
    op: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    source_ms: int | None = None,
    lsn: int | None = None,
) -> dict[str, Any]:
    source: dict[str, Any] = {"connector": "postgresql", "db": "shop", "table": "products"}
    if source_ms is not None:
        source["ts_ms"] = source_ms
    if lsn is not None:
        source["lsn"] = lsn
    return {"before": before, "after": after, "source": source, "op": op, "ts_ms": TS_MS + 999}


def wrapped(payload: Any) -> dict[str, Any]:
    return {
        "schema": {"type": "struct", "optional": False, "name": "shop.products.Envelope"},
        "payload": payload,
    }


def test_debezium_envelopes_with_and_without_the_schema_wrapper(spark: SparkSession) -> None:
    cfg = replica({"products": PRODUCTS})
    p1 = {"id": 1, "name": "pen", "price": 1.5}
    p1b = {"id": 1, "name": "pen", "price": None}
    p2 = {"id": 2, "name": "ink", "price": 3.0}
    rows = [
        record({"id": 1}, dbz("c", None, p1, source_ms=TS_MS), 0, topic="dbz"),
        record(wrapped({"id": 1}), wrapped(dbz("u", p1, p1b, source_ms=TS_MS + 1)), 1, topic="dbz"),
        record({"id": 2}, dbz("r", None, p2), 2, topic="dbz"),
        record({"id": 1}, dbz("d", p1b, None, source_ms=TS_MS + 2), 3, topic="dbz"),
        record({"id": 1}, None, 4, topic="dbz"),
        record(wrapped({"id": 2}), wrapped(dbz("d", p2, None)), 5, topic="dbz"),
        record({"id": 2}, dbz("c", None, p2), 6, topic="dbz"),  # the same change twice
        record({"id": 2}, dbz("c", None, p2), 7, topic="dbz"),
        record({"id": 3}, dbz("t", None, None), 8, topic="dbz"),
        record({"id": 3}, dbz("c", None, None), 9, topic="dbz"),
        record({"id": 3}, {"before": None, "after": {"id": 3}}, 10, topic="dbz"),
        record(None, dbz("c", None, {"id": 3, "name": "x", "price": 1.0}), 11, topic="dbz"),
        record({"id": 3}, b"not json", 12, topic="dbz"),
        record({"id": 3}, dbz("c", None, {"id": 3, "name": "x", "price": "cheap"}), 13, topic="dbz"),
        record({"id": 4}, dbz("c", None, {"id": 3, "name": "x", "price": 1.0}), 14, topic="dbz"),
    ]
    changes_df = decode_table(spark, cfg, rows, "products")

    assert changes_df.columns == ["id", "name", "price", *CHANGE_TAIL]
    assert errors(changes_df) == [
        (8, "unsupported Debezium op 't' (expected c, r, u or d)"),
        (9, "Debezium change without 'after'"),
        (10, "missing op in the Debezium payload"),
        (11, "missing key: the Kafka record key is null"),
        (12, f"value is not a JSON object: {NOT_JSON}"),
        (13, "data does not match the table schema: price (double)"),
        (14, "the record key does not match the key columns in data"),
    ]
    assert_df_equality(
        typed(changes_df, "id", "name", "price"),
        spark.createDataFrame(
            [
                (1, "pen", 1.5, "upsert", None, False, "dbz", 0, 0, TS_MS),
                (1, "pen", None, "upsert", None, False, "dbz", 0, 1, TS_MS + 1),
                (2, "ink", 3.0, "upsert", None, False, "dbz", 0, 2, TS_MS + 999),
                (1, None, None, "delete", None, False, "dbz", 0, 3, TS_MS + 2),
                (1, None, None, "delete", None, True, "dbz", 0, 4, None),
                (2, None, None, "delete", None, False, "dbz", 0, 5, TS_MS + 999),
                (2, "ink", 3.0, "upsert", None, False, "dbz", 0, 6, TS_MS + 999),
                (2, "ink", 3.0, "upsert", None, False, "dbz", 0, 7, TS_MS + 999),
            ],
            f"id BIGINT, name STRING, price DOUBLE, {META_DDL}",
        ),
        ignore_row_order=True,
        ignore_nullable=True,
    )


def test_debezium_delete_on_a_table_sequenced_by_a_row_column(spark: SparkSession) -> None:
    """A Debezium delete carries its row (with the sequence column) in ``before``, not in ``after``."""
    cfg = replica(
        {
            "products": {
                **PRODUCTS,
                "schema": "id BIGINT, name STRING, version BIGINT",
                "sequence_by": "version",
            }
        }
    )
    rows = [
        record({"id": 1}, dbz("c", None, {"id": 1, "name": "pen", "version": 4}), 0, topic="dbz"),
        record({"id": 1}, dbz("d", {"id": 1, "name": "pen", "version": 4}, None), 1, topic="dbz"),
        record({"id": 1}, None, 2, topic="dbz"),
    ]
    changes_df = decode_table(spark, cfg, rows, "products")
    assert errors(changes_df) == []
    assert [(r["_offset"], r["_op"], r["_seq"]) for r in changes_df.orderBy("_offset").collect()] == [
        (0, "upsert", 4),
        (1, "delete", 4),
        (2, "delete", None),
    ]


def test_debezium_sequenced_by_a_payload_field(spark: SparkSession) -> None:
    cfg = replica({"products": {**PRODUCTS, "sequence_by": "source.lsn"}})
    pen = {"id": 1, "name": "pen", "price": 1.0}
    rows = [
        record({"id": 1}, dbz("c", None, pen, lsn=100), 0, topic="dbz"),
        record(wrapped({"id": 1}), wrapped(dbz("d", pen, None, lsn=130)), 1, topic="dbz"),
        record({"id": 1}, None, 2, topic="dbz"),
        record({"id": 1}, dbz("u", pen, pen), 3, topic="dbz"),
    ]
    changes_df = decode_table(spark, cfg, rows, "products")
    assert errors(changes_df) == [(3, "missing sequence: table products is ordered by source.lsn")]
    assert [(r["_offset"], r["_op"], r["_seq"]) for r in decode.valid(changes_df).orderBy("_offset").collect()] == [
        (0, "upsert", 100),
        (1, "delete", 130),
        (2, "delete", None),
    ]


@pytest.mark.parametrize("fmt", ["native", "debezium"])
def test_envelope_columns(spark: SparkSession, fmt: str) -> None:
    cfg = replica({"orders": {**ORDERS, "format": fmt}})
    env_df = decode.envelopes(spark.createDataFrame([], RAW_SCHEMA), cfg, schemas_of(cfg))
    # A native topic that carries one table also brings its rows typed by the envelope's parse.
    # A Debezium topic's records bring their Connect schema's field schemas (for logical types).
    typed = [decode.typed_data_column("orders")] if fmt == "native" else [logical.CONNECT_FIELDS]
    assert env_df.columns == [*decode.ENVELOPE_COLUMNS, *typed]


# ---------------------------------------------------------------------------------------------- strictness
def upsert_bytes(data: str) -> bytes:
    return f'{{"op": "upsert", "seq": 2, "data": {data}}}'.encode()


def test_only_strict_json_in_utf8_decodes(spark: SparkSession) -> None:
    """Every record that Spark's lenient JSON reading would have taken as data (found in the field) is rejected."""
    cfg = replica({"orders": ORDERS})
    key = {"order_id": 1}
    ok = bytes(js({"op": "upsert", "seq": 2, "data": order(1, "ada", 1.0, "new", 1)}))
    deep = b'{"op": "upsert", "seq": 2, "data": {"order_id": 1, "status": ' + b"[" * 1200 + b"]" * 1200 + b"}}"
    rows = [
        record(key, ok, 0),
        record(key, ok.replace(b"ada", b"\xffda"), 1),
        record(b'{"order_id": 1, "\xff": 2}', ok, 2),
        record(key, ok + b" x", 3),
        record(key, ok + ok, 4),
        record(key, ok + b"]", 5),  # would close the decoder's own wrapper
        record(key, ok + b', {"op": "delete"}', 6),
        record(key, b'{"op": "upsert", "op": "delete", "seq": 2}', 7),
        record(key, upsert_bytes('{"order_id": 1, "status": "a", "status": "b"}'), 8),
        record(b'{"order_id": 1, "order_id": 2}', ok, 9),
        record(key, b"{'op': 'upsert', 'seq': 2, 'data': {'order_id': 1}}", 10),
        record(key, upsert_bytes('{"order_id": 1, "amount": NaN}'), 11),
        record(key, upsert_bytes('{"order_id": 1, "amount": -Infinity}'), 12),
        record(key, upsert_bytes('{"order_id": 1, "amount": 01}'), 13),
        record(key, upsert_bytes('{"order_id": 1, /* note */ "amount": 1}'), 14),
        record(key, deep, 15),
        record(b'{"order_id": 1} x', ok, 16),
        record(b'{"order_id": 1}{"order_id": 2}', ok, 17),
        record(b"", ok, 18),
        record(key, b"   ", 19),
        record(key, b"\x8f\x00\xfe binary", 20),
        record(key, b'  {"op": "upsert", "seq": 2, "data": {"order_id": 1, "status": "a]b"}}\n', 21),
        record(b'{"order_id": ' + b"[" * 1200 + b"]" * 1200 + b"}", ok, 22),
        record(b"{'order_id': 1}", ok, 23),
        record(key, upsert_bytes('{"order_id": 1, "status": "\\ud800"}'), 24),
        record(key, upsert_bytes('{"order_id": 1, "status": "a\\udc00\\ud83d\\ude00"}'), 25),
        record(key, upsert_bytes('{"order_id": 1, "status": "\\ud83d\\ude00 \\\\ud800"}'), 26),  # a pair; a backslash
        record({"order_id": 1, "status": "\ud800"}, ok, 27),
        record(key, upsert_bytes('{"order_id": 1, "status": "\\ud83d\\ude00", "status": "b"}'), 28),  # a pair
        record(key, upsert_bytes('{"order_id": 1, "status": "\\\\ud800", "status": "b"}'), 29),  # a backslash
    ]
    changes_df = decode_table(spark, cfg, rows, "orders")
    after = "value has content after its JSON object"
    assert errors(changes_df) == [
        (1, "value is not valid UTF-8"),
        (2, "key is not valid UTF-8"),
        (3, after),
        (4, after),
        (5, after),
        (6, after),
        (7, "value has a duplicate field name"),
        (8, "value has a duplicate field name"),
        (9, "key has a duplicate field name"),
        (10, f"value is not a JSON object: {NOT_JSON}"),
        (11, f"value is not a JSON object: {NOT_JSON}"),
        (12, f"value is not a JSON object: {NOT_JSON}"),
        (13, f"value is not a JSON object: {NOT_JSON}"),
        (14, f"value is not a JSON object: {NOT_JSON}"),
        (15, "value nests deeper than 1000 levels"),
        (16, "key has content after its JSON object"),
        (17, "key has content after its JSON object"),
        (18, "key is empty (zero bytes)"),
        (19, f"value is not a JSON object: {NOT_JSON}"),
        (20, "value is not valid UTF-8"),
        (22, "key nests deeper than 1000 levels"),
        (23, f"key is not a JSON object of the key columns (order_id): {NOT_JSON}"),
        (24, "value has a \\u escape of half a surrogate pair (no character)"),
        (25, "value has a \\u escape of half a surrogate pair (no character)"),
        (27, "key has a \\u escape of half a surrogate pair (no character)"),
        (28, "value has a duplicate field name"),
        (29, "value has a duplicate field name"),
    ]
    assert offsets(decode.valid(changes_df)) == [0, 21, 26]
    assert changes_df.count() == len(rows)
    kept = changes_df.where(F.col("_offset").isin(1, 5)).orderBy("_offset").collect()
    assert [bytes(r["_value"]) for r in kept] == [ok.replace(b"ada", b"\xffda"), ok + b"]"]


def _interpreted_projections(plan: Any) -> list[list[str]]:
    """The expressions of each projection of a physical plan outside whole-stage code generation."""
    found: list[list[str]] = []

    def walk(node: Any, generated: bool) -> None:
        name = node.getClass().getSimpleName()
        generated = (generated or name == "WholeStageCodegenExec") and name != "InputAdapter"
        if name == "ProjectExec" and not generated:
            exprs = node.projectList()
            found.append([exprs.apply(i).toString() for i in range(exprs.size())])
        children = node.children()
        for i in range(children.size()):
            walk(children.apply(i), generated)

    walk(plan, False)
    return found


def test_a_decodes_parses_stay_apart_from_its_checks(spark: SparkSession) -> None:
    """Spark interprets ``from_json``: a projection holding one runs outside whole-stage code generation, and every
    task generates its code again. Such projections hold parses and renamed columns only, never the checks."""
    cfg = replica({"orders": ORDERS})
    schemas = schemas_of(cfg)
    rows = [record({"order_id": 1}, {"op": "upsert", "seq": 1, "data": order(1, "ada", 1.0, "new", 1)}, 0)]
    env_df = decode.envelopes(spark.createDataFrame(rows, RAW_SCHEMA), cfg, schemas)
    changes_df = decode.table_changes(env_df, schemas["orders"], unrouted=True, alone=True)
    adaptive = spark.conf.get("spark.sql.adaptive.enabled")
    spark.conf.set("spark.sql.adaptive.enabled", "false")  # so that the plan holds its code generation stages
    try:
        projections = _interpreted_projections(changes_df._jdf.queryExecution().executedPlan())
    finally:
        spark.conf.set("spark.sql.adaptive.enabled", adaptive)
    assert len(projections) >= 3  # the envelope's, the key's and the row's parses at least
    renamed = re.compile(r"[^\s()]+#\d+L?( AS [^\s()]+#\d+L?)?")
    for expressions in projections:
        assert all("from_json(" in e or renamed.fullmatch(e) for e in expressions), expressions


def test_types_are_as_declared_without_coercion(spark: SparkSession) -> None:
    cfg = replica(
        {"orders": ORDERS, "accounts": {"topic": "accounts", "keys": ["name"], "schema": "name STRING, n BIGINT"}}
    )
    key = {"order_id": 1}

    def up(**data: Any) -> dict[str, Any]:
        return {"op": "upsert", "seq": 2, "data": {"order_id": 1, **data}}

    rows = [
        record(key, up(customer=5), 0),
        record(key, up(status=True), 1),
        record(key, up(customer={"first": "ada"}, status=["new"]), 2),
        record(key, up(customer="5", status="true"), 3),  # strings that look like other JSON values stay strings
        record(key, up(updated_ms=1.5), 4),
        record(key, up(updated_ms=1.0), 5),
        record(key, bytes(upsert_bytes('{"order_id": 1, "updated_ms": 99999999999999999999}')), 6),
        record(key, up(updated_ms="5"), 7),
        record(key, up(amount="NaN"), 8),
        record(key, bytes(upsert_bytes('{"order_id": 1, "amount": 1e400}')), 9),
        record(key, up(amount=2), 10),  # an integer is a double
        record({"order_id": 1, "region": "eu"}, up(), 11),
        record(key, {"op": 5, "seq": 2, "data": {"order_id": 1}}, 12),
        record(key, {"op": "upsert", "table": True, "seq": 2, "data": {"order_id": 1}}, 13),
        record(key, {}, 14),
        record(key, {"op": "upsert", "seq": 2, "data": {}}, 15),
        record(key, up(note="not in the schema"), 16),  # unknown fields in data are ignored
        record(key, {"op": "delete", "seq": 3, "origin": "billing"}, 17),  # so are unknown envelope fields
        record({"name": 5}, {"op": "upsert", "data": {"name": 5, "n": 1}}, 0, topic="accounts"),
        record({"name": "5"}, {"op": "upsert", "data": {"name": "5", "n": 1}}, 1, topic="accounts"),
    ]
    orders_df = decode_table(spark, cfg, rows, "orders", unrouted=True)  # a record of no table is rejected too
    accounts_df = decode_table(spark, cfg, rows, "accounts")
    schema_error = "data does not match the table schema: "
    wrong_type = "envelope has a field of the wrong type (op and table are strings, seq and ts_ms integers)"
    assert errors(orders_df) == [
        (0, schema_error + "customer (string)"),
        (1, schema_error + "status (string)"),
        (2, schema_error + "customer (string), status (string)"),
        (4, schema_error + "updated_ms (bigint)"),
        (5, schema_error + "updated_ms (bigint)"),
        (6, schema_error + "updated_ms (bigint)"),
        (7, schema_error + "updated_ms (bigint)"),
        (8, schema_error + "amount (double)"),
        (9, schema_error + "amount (double)"),
        (11, "key has a field that is not a key column: region (the key columns: order_id)"),
        (12, wrong_type),
        (13, wrong_type),
        (14, "missing op"),
        (15, "the record key does not match the key columns in data"),
    ]
    assert errors(accounts_df) == [(0, "key has a column of the wrong type (expected name string)")]
    assert_df_equality(
        typed(orders_df, "order_id", "customer", "amount", "status"),
        spark.createDataFrame(
            [
                (1, "5", None, "true", "upsert", 2, False, "orders", 0, 3, None),
                (1, None, 2.0, None, "upsert", 2, False, "orders", 0, 10, None),
                (1, None, None, None, "upsert", 2, False, "orders", 0, 16, None),
                (1, None, None, None, "delete", 3, False, "orders", 0, 17, None),
            ],
            f"order_id BIGINT, customer STRING, amount DOUBLE, status STRING, {META_DDL}",
        ),
        ignore_row_order=True,
        ignore_nullable=True,
    )


def test_debezium_records_are_as_strict(spark: SparkSession) -> None:
    cfg = replica({"products": PRODUCTS})
    pen = {"id": 1, "name": "pen", "price": 1.0}
    ok = bytes(js(dbz("c", None, pen)))
    rows = [
        record({"id": 1}, ok, 0, topic="dbz"),
        record({"id": 1}, ok + b" x", 1, topic="dbz"),
        record({"id": 1}, ok.replace(b'"op": "c"', b'"op": "c", "op": "d"'), 2, topic="dbz"),
        record({"id": 1}, ok.replace(b"pen", b"p\xffn"), 3, topic="dbz"),
        record({"id": 1}, ok.replace(b"1.0", b"NaN"), 4, topic="dbz"),
        record({"id": 1}, dbz("c", None, {**pen, "name": 7}), 5, topic="dbz"),
        record({"id": 1, "db": "shop"}, ok, 6, topic="dbz"),
        record(wrapped({"id": 1}), bytes(js(wrapped(dbz("c", None, pen)))) + b"}", 7, topic="dbz"),
    ]
    changes_df = decode_table(spark, cfg, rows, "products")
    assert errors(changes_df) == [
        (1, "value has content after its JSON object"),
        (2, "value has a duplicate field name"),
        (3, "value is not valid UTF-8"),
        (4, f"value is not a JSON object: {NOT_JSON}"),
        (5, "data does not match the table schema: name (string)"),
        (6, "key has a field that is not a key column: db (the key columns: id)"),
        (7, "value has content after its JSON object"),
    ]


def test_a_string_with_half_a_surrogate_pair_is_refused_in_a_plain_key_and_value(spark: SparkSession) -> None:
    """A typed parse reads a ``\\u`` escape of half a surrogate pair, and Spark stores it as ``?`` (``"a\\ud800b"``
    was ``a?b``): a key or value that is otherwise plain (no strict parse) must be refused too."""
    cfg = replica({"accounts": {"topic": "accounts", "keys": ["name"], "schema": "name STRING, note STRING"}})

    def value(name: str, note: str) -> bytes:
        return ('{"op":"upsert","data":{"name":"' + name + '","note":"' + note + '"}}').encode()

    rows = [
        record(b'{"name":"ada"}', value("ada", "a\\ud800b"), 0, topic="accounts"),
        record(b'{"name":"a\\udc00"}', value("a", "fine"), 1, topic="accounts"),
        record(b'{"name":"zo\\u00eb"}', value("zo\\u00eb", "\\ud83d\\ude00"), 2, topic="accounts"),
    ]
    changes_df = decode_table(spark, cfg, rows, "accounts")
    half = "has a \\u escape of half a surrogate pair (no character)"
    assert errors(changes_df) == [(0, f"value {half}"), (1, f"key {half}")]
    assert [(r["name"], r["note"]) for r in decode.valid(changes_df).collect()] == [("zo\u00eb", "\U0001f600")]


# ---------------------------------------------------------------------------------------------- logical types
EVENTS = {
    "topic": "dbz",
    "format": "debezium",
    "keys": ["id"],
    "schema": "id BIGINT, note STRING, at TIMESTAMP, at_local TIMESTAMP_NTZ, day DATE, price DECIMAL(10,2), "
    "ratio DECIMAL(20,5)",
}
AT = datetime(2024, 5, 6, 10, 15, 30, 123456)
AT_MICROS = 1_714_990_530_123_456  # AT in UTC
DAY_COUNT = 19_849  # 2024-05-06


def unscaled(value: int) -> str:
    """A Connect Decimal's unscaled value: big-endian two's complement, base64."""
    size = max(1, (value.bit_length() + 8) // 8)
    return base64.b64encode(value.to_bytes(size, "big", signed=True)).decode()


def connect_schema(columns: dict[str, tuple[str, str | None, dict[str, str] | None]]) -> dict[str, Any]:
    """A Debezium envelope's Connect schema whose row image has ``columns``: name -> (type, logical name, params)."""
    fields = []
    for name, (kind, logical_name, parameters) in columns.items():
        field: dict[str, Any] = {"type": kind, "optional": True, "field": name}
        if logical_name:
            field["name"] = logical_name
        if parameters:
            field["parameters"] = parameters
        fields.append(field)
    row = {"type": "struct", "fields": fields, "optional": True, "name": "shop.public.events.Value"}
    return {
        "type": "struct",
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            {"type": "struct", "fields": [], "optional": False, "field": "source"},
            {"type": "string", "optional": False, "field": "op"},
        ],
        "optional": False,
        "name": "shop.public.events.Envelope",
    }


def with_schema(payload: dict[str, Any], **units: tuple[str, str | None, dict[str, str] | None]) -> dict[str, Any]:
    columns = {"id": ("int64", None, None), "note": ("string", None, None), **units}
    return {"schema": connect_schema(columns), "payload": payload}


MICRO = ("int64", "io.debezium.time.MicroTimestamp", None)
DECIMAL_2 = ("bytes", "org.apache.kafka.connect.data.Decimal", {"scale": "2", "connect.decimal.precision": "10"})


def test_debezium_values_are_converted_by_their_logical_type_and_never_guessed(spark: SparkSession) -> None:
    cfg = replica({"events": EVENTS})
    row = {"id": 1, "note": "n", "at": None, "at_local": None, "day": None, "price": None, "ratio": None}
    dated = {
        **row,
        "at": AT_MICROS,
        "at_local": AT_MICROS,
        "day": DAY_COUNT,
        "price": unscaled(12345),
        "ratio": {"scale": 3, "value": unscaled(-1234567)},
    }
    units = {
        "at": MICRO,
        "at_local": MICRO,
        "day": ("int32", "io.debezium.time.Date", None),
        "price": DECIMAL_2,
        "ratio": ("struct", "io.debezium.data.VariableScaleDecimal", None),
    }
    millis = ("int64", "io.debezium.time.Timestamp", None)
    nanos = ("int64", "io.debezium.time.NanoTimestamp", None)
    zoned = ("string", "io.debezium.time.ZonedTimestamp", None)
    decimal_3 = ("bytes", "org.apache.kafka.connect.data.Decimal", {"scale": "3"})
    rows = [
        record({"id": 1}, with_schema(dbz("c", None, dated), **units), 0, topic="dbz"),
        record({"id": 2}, with_schema(dbz("c", None, {**row, "id": 2, "at": AT_MICROS // 1000}), at=millis), 1, "dbz"),
        record({"id": 3}, with_schema(dbz("c", None, {**row, "id": 3, "at": AT_MICROS * 1000}), at=nanos), 2, "dbz"),
        record(
            {"id": 4},
            with_schema(dbz("c", None, {**row, "id": 4, "at": "2024-05-06T10:15:30.123456Z"}), at=zoned),
            3,
            "dbz",
        ),
        record(
            {"id": 5}, with_schema(dbz("c", None, {**row, "id": 5, "price": unscaled(-5)}), price=DECIMAL_2), 4, "dbz"
        ),
        record(
            {"id": 6},
            with_schema(dbz("c", None, {**row, "id": 6, "price": unscaled(123450)}), price=decimal_3),
            5,
            "dbz",
        ),
        # Refused: a unit that loses digits, a unit-less number, a value its column cannot hold, a missing value.
        record(
            {"id": 7}, with_schema(dbz("c", None, {**row, "id": 7, "at": AT_MICROS * 1000 + 1}), at=nanos), 6, "dbz"
        ),
        record({"id": 8}, dbz("c", None, {**row, "id": 8, "at": AT_MICROS}), 7, topic="dbz"),
        record(
            {"id": 9},
            with_schema(dbz("c", None, {**row, "id": 9, "price": unscaled(123456)}), price=decimal_3),
            8,
            "dbz",
        ),
        record(
            {"id": 10},
            with_schema(dbz("c", None, {**row, "id": 10, "price": unscaled(10**12)}), price=DECIMAL_2),
            9,
            "dbz",
        ),
        record({"id": 11}, dbz("u", None, {**row, "id": 11, "note": "__debezium_unavailable_value"}), 10, topic="dbz"),
        record({"id": 12}, dbz("c", None, {**row, "id": 12, "day": DAY_COUNT}), 11, topic="dbz"),
        # A DECIMAL as a string (decimal.handling.mode = string) is not rounded to its column's scale.
        record({"id": 13}, dbz("c", None, {**row, "id": 13, "price": "12.345"}), 12, topic="dbz"),
        record({"id": 14}, dbz("c", None, {**row, "id": 14, "price": "12.340"}), 13, topic="dbz"),
    ]
    changes_df = decode_table(spark, cfg, rows, "events")

    unit_less = "a number with no unit: send Debezium's schema with it (value.converter.schemas.enable=true)"
    assert errors(changes_df) == [
        (6, "data does not match the table schema: at (timestamp)"),
        (7, f"data does not match the table schema: at (timestamp, {unit_less})"),
        (8, "data does not match the table schema: price (decimal(10,2))"),
        (9, "data does not match the table schema: price (decimal(10,2))"),
        (
            10,
            "Debezium sent no value for note ('__debezium_unavailable_value': an unchanged TOASTed value; set "
            "REPLICA IDENTITY FULL on the source table, see the README's Debezium settings)",
        ),
        (11, f"data does not match the table schema: day (date, {unit_less})"),
        (12, f"data does not match the table schema: price (decimal(10,2), {logical.BEYOND_SCALE})"),
    ]
    got = {
        r["id"]: r
        for r in decode.valid(changes_df)
        .select("id", F.unix_micros("at").alias("at"), "at_local", "day", "price", "ratio")
        .collect()
    }
    assert sorted(got) == [1, 2, 3, 4, 5, 6, 14]
    assert str(got[14]["price"]) == "12.34"
    assert got[1]["at"] == AT_MICROS and got[1]["at_local"] == AT
    assert str(got[1]["day"]) == "2024-05-06"
    assert (str(got[1]["price"]), str(got[1]["ratio"])) == ("123.45", "-1234.56700")
    assert got[2]["at"] == AT_MICROS // 1000 * 1000
    assert got[3]["at"] == got[4]["at"] == AT_MICROS
    assert (str(got[5]["price"]), str(got[6]["price"])) == ("-0.05", "123.45")


def test_a_debezium_time_of_day_is_kept_as_its_text_by_its_logical_type(spark: SparkSession) -> None:
    cfg = replica(
        {"events": {"topic": "dbz", "format": "debezium", "keys": ["id"], "schema": "id BIGINT, note STRING"}}
    )
    at = 12 * 3_600_000_000 + 34 * 60_000_000 + 56_789_012  # 12:34:56.789012 in microseconds
    micro, millis = ("int64", "io.debezium.time.MicroTime", None), ("int32", "io.debezium.time.Time", None)
    nanos = ("int64", "io.debezium.time.NanoTime", None)

    def change(i: int, note: Any, unit: tuple[str, str | None, dict[str, str] | None] | None) -> RawRow:
        payload = dbz("c", None, {"id": i, "note": note})
        return record({"id": i}, with_schema(payload, note=unit) if unit else payload, i - 1, "dbz")

    rows = [
        change(1, at, micro),
        change(2, at // 1000, millis),
        change(3, at * 1000, nanos),
        change(4, 86_400_000_000, micro),  # PostgreSQL's 24:00:00
        change(5, "12:00", ("string", None, None)),  # a plain string is kept as it is
        # Refused: finer than microseconds, outside a day, a number with no time unit.
        change(6, at * 1000 + 1, nanos),
        change(7, -1, micro),
        change(8, at, ("int64", None, None)),
    ]
    changes_df = decode_table(spark, cfg, rows, "events")

    got = {r["id"]: r["note"] for r in decode.valid(changes_df).select("id", "note").collect()}
    assert got == {1: "12:34:56.789012", 2: "12:34:56.789000", 3: "12:34:56.789012", 4: "24:00:00.000000", 5: "12:00"}
    assert errors(changes_df) == [(o, "data does not match the table schema: note (string)") for o in (5, 6, 7)]


def test_the_reason_names_each_column_debezium_sent_no_value_for(spark: SparkSession) -> None:
    cfg = replica(
        {
            "events": {
                "topic": "dbz",
                "format": "debezium",
                "keys": ["id"],
                "schema": "id BIGINT, a STRING, b STRING, c STRING",
            }
        }
    )
    row = {"id": 1, "a": "kept", "b": "kept", "c": "kept"}
    rows = [
        record({"id": 1}, dbz("u", None, {**row, "c": "__debezium_unavailable_value"}), 0, "dbz"),
        record(
            {"id": 2},
            dbz("u", None, {**row, "id": 2, "a": "__debezium_unavailable_value", "c": "__debezium_unavailable_value"}),
            1,
            "dbz",
        ),
    ]
    reason = (
        "('__debezium_unavailable_value': an unchanged TOASTed value; set REPLICA IDENTITY FULL on the source "
        "table, see the README's Debezium settings)"
    )
    assert errors(decode_table(spark, cfg, rows, "events")) == [
        (0, f"Debezium sent no value for c {reason}"),
        (1, f"Debezium sent no value for a, c {reason}"),
    ]


def key_with_schema(payload: dict[str, Any], **units: tuple[str, str | None, dict[str, str] | None]) -> dict[str, Any]:
    """A Debezium record key wrapped with its Connect schema: a struct of the key columns, with their logical types."""
    fields = [
        {"type": kind, "optional": False, "field": name, **({"name": logical_name} if logical_name else {})}
        for name, (kind, logical_name, _) in units.items()
    ]
    return {"schema": {"type": "struct", "fields": fields, "name": "shop.public.events.Key"}, "payload": payload}


DATE_UNIT = ("int32", "io.debezium.time.Date", None)
ZONED = ("string", "io.debezium.time.ZonedTimestamp", None)


def test_a_debezium_date_or_time_key_is_read_by_its_logical_type(spark: SparkSession) -> None:
    """A PostgreSQL table keyed by a date or a timestamp (a partitioned table's key holds its partition column) sends
    its key as days or microseconds with the key's Connect schema: the key reads them as the row does. Spark's parse
    refused the days and read the microseconds as seconds, so every change of such a table was quarantined."""
    cfg = replica(
        {
            "days": {"topic": "dbz", "format": "debezium", "keys": ["day"], "schema": "day DATE, note STRING"},
            "ticks": {"topic": "ticks", "format": "debezium", "keys": ["at"], "schema": "at TIMESTAMP, note STRING"},
        }
    )
    rows = [
        record(
            key_with_schema({"day": DAY_COUNT}, day=DATE_UNIT),
            with_schema(dbz("c", None, {"day": DAY_COUNT, "note": "a"}), day=DATE_UNIT),
            0,
            "dbz",
        ),
        record({"day": "2024-05-06"}, dbz("c", None, {"day": "2024-05-06", "note": "b"}), 1, "dbz"),
        record({"day": DAY_COUNT}, dbz("c", None, {"day": "2024-05-06", "note": "c"}), 2, "dbz"),  # no unit
        record({"day": "20240506"}, dbz("c", None, {"day": "2024-05-06", "note": "d"}), 3, "dbz"),
    ]
    ticks = [
        record(
            key_with_schema({"at": AT_MICROS}, at=MICRO),
            with_schema(dbz("c", None, {"at": AT_MICROS, "note": "a"}), at=MICRO),
            0,
            "ticks",
        ),
        record(
            key_with_schema({"at": AT_TEXT}, at=ZONED),
            with_schema(dbz("c", None, {"at": AT_TEXT, "note": "b"}), at=ZONED),
            1,
            "ticks",
        ),
        record(
            key_with_schema({"at": AT_MICROS + 1}, at=MICRO),
            with_schema(dbz("c", None, {"at": AT_MICROS, "note": "c"}), at=MICRO),
            2,
            "ticks",
        ),
    ]
    days_df = decode_table(spark, cfg, rows, "days")
    wrong = "key has a column of the wrong type (expected day date)"
    assert errors(days_df) == [(2, wrong), (3, wrong)]
    assert [(str(r["day"]), r["note"]) for r in decode.valid(days_df).orderBy("_offset").collect()] == [
        ("2024-05-06", "a"),
        ("2024-05-06", "b"),
    ]
    ticks_df = decode_table(spark, cfg, ticks, "ticks")
    assert errors(ticks_df) == [(2, "the record key does not match the key columns in data")]
    valid = decode.valid(ticks_df).orderBy("_offset").select(F.unix_micros("at").alias("at"), "note").collect()
    assert [tuple(r) for r in valid] == [(AT_MICROS, "a"), (AT_MICROS, "b")]


def test_a_number_for_a_native_timestamp_has_no_unit_and_is_refused(spark: SparkSession) -> None:
    cfg = replica({"events": {"topic": "ev", "keys": ["id"], "schema": "id BIGINT, at TIMESTAMP, day DATE"}})

    def up(at: Any, day: Any = None) -> dict[str, Any]:
        return {"op": "upsert", "data": {"id": 1, "at": at, "day": day}}

    rows = [
        record({"id": 1}, up("2024-05-06T10:15:30.123456Z", "2024-05-06"), 0, topic="ev"),
        record({"id": 1}, up(1714990530), 1, topic="ev"),
        record({"id": 1}, up(None, 19849), 2, topic="ev"),
    ]
    changes_df = decode_table(spark, cfg, rows, "events")
    how = "a number with no unit: send a string such as"
    assert errors(changes_df) == [
        (1, f"data does not match the table schema: at (timestamp, {how} 2024-05-06T10:15:30.123456Z)"),
        (2, f"data does not match the table schema: day (date, {how} 2024-05-06)"),
    ]
    (valid,) = decode.valid(changes_df).select(F.unix_micros("at").alias("at")).collect()
    assert valid["at"] == AT_MICROS


#: Texts of dates and times that Spark's own parser reads, and what the contract says of each.
DATE_TEXTS = {
    "2024-05-06": "2024-05-06",
    "0001-01-01": "0001-01-01",
    "20240506": None,  # Spark: a day of the year 57386
    "2024-05-06 garbage": None,  # Spark: 2024-05-06 (what follows a space or a T is dropped)
    "2024-05-06T10:15:30Z": None,  # a time, whose zone may even change the day
    "2024-5-6": None,
    "2024-05": None,  # Spark: 2024-05-01
    " 2024-05-06": None,
    "-0044-03-15": None,
}
TIMESTAMP_TEXTS = {
    "2024-05-06T10:15:30.123456Z": "2024-05-06 10:15:30.123456",
    "2024-05-06 10:15:30.123+02:00": "2024-05-06 08:15:30.123",
    "2024-05-06T10:15:30 Europe/Paris": "2024-05-06 08:15:30",
    "2024-05-06T10:15:30+0200": "2024-05-06 08:15:30",
    "2024-05-06T10:15:30+02": "2024-05-06 08:15:30",
    "2024-05-06T10:15:30UTC": "2024-05-06 10:15:30",
    "2024-07-01 10:00:00 Europe/London": "2024-07-01 09:00:00",
    "2024-07-01 10:00:00 BST": None,  # Java: Asia/Dhaka (04:00Z), not London's summer time
    "2024-07-01T10:00:00CST": None,  # Java: America/Chicago, whatever the sender meant (China's is 13 hours off)
    "2024-05-06T10:15:30.123456000Z": "2024-05-06 10:15:30.123456",  # nanoseconds that are whole microseconds
    "2024-05-06T10:15": "2024-05-06 10:15:00",
    "2024-05-06": "2024-05-06 00:00:00",
    "10:15:30": None,  # Spark: today at 10:15:30, so a rebuild tomorrow differs
    "T10:15:30": None,
    "2024-05-06T10:15:30.1234567Z": None,  # Spark: rounded to microseconds
    "2024-05-06T10": None,
    "2024": None,
    "2024-05-06T10:15:30Z garbage": None,
}
NTZ_TEXTS = {
    "2024-05-06T10:15:30.123456": "2024-05-06 10:15:30.123456",
    "2024-05-06 10:15": "2024-05-06 10:15:00",
    "2024-05-06T10:15:30Z": None,
    "10:15:30": None,
}


def _temporal_cases() -> list[tuple[str, str, str | None]]:
    return [
        *[("day", text, want) for text, want in DATE_TEXTS.items()],
        *[("at", text, want) for text, want in TIMESTAMP_TEXTS.items()],
        *[("local", text, want) for text, want in NTZ_TEXTS.items()],
    ]


TEMPORAL_SCHEMA = "id BIGINT, at TIMESTAMP, local TIMESTAMP_NTZ, day DATE, amount DECIMAL(10,2)"
TEMPORAL_KINDS = {"day": "date", "at": "timestamp", "local": "timestamp_ntz"}
TEMPORAL_FORMS = {"day": "2024-05-06", "at": "2024-05-06T10:15:30.123456Z", "local": "2024-05-06T10:15:30.123456"}


def _temporal_reason(column: str, text: str) -> str:
    kind, form = TEMPORAL_KINDS[column], TEMPORAL_FORMS[column]
    if re.fullmatch("[0-9]+", text):  # a string of digits reads as a number
        why = f"a number with no unit: send a string such as {form}"
    else:
        why = f"not of the form {form}: see the contract's dates and times"
    return f"data does not match the table schema: {column} ({kind}, {why})"


def _as_text(df: DataFrame) -> dict[int, dict[str, Any]]:
    cast = [F.col(c).cast("string").alias(c) for c in ("day", "at", "local", "amount")]
    return {row["_offset"]: row.asDict() for row in decode.valid(df).select("_offset", *cast).collect()}


@pytest.mark.parametrize("layout", ["one table", "two tables"])
def test_dates_and_times_are_read_in_their_iso_form_only(spark: SparkSession, layout: str) -> None:
    """Spark's parser reads many texts into a DATE or TIMESTAMP (a time alone on the day it runs, eight digits as a
    far-off year, a date followed by anything): each such record is quarantined with a reason, on the typed path of
    a one-table topic and on the untyped path of a topic of two tables."""
    events = {"topic": "ev", "keys": ["id"], "schema": TEMPORAL_SCHEMA}
    tables = {"events": events} if layout == "one table" else {"events": events, "other": {**events, "keys": ["id"]}}
    cfg = replica(tables)
    cases = _temporal_cases()
    table = {} if layout == "one table" else {"table": "events"}
    rows = [
        record({"id": 1}, {"op": "upsert", **table, "data": {"id": 1, column: text}}, offset, topic="ev")
        for offset, (column, text, _) in enumerate(cases)
    ]
    changes_df = decode_table(spark, cfg, rows, "events")
    got = _as_text(changes_df)
    assert errors(changes_df) == [
        (offset, _temporal_reason(column, text)) for offset, (column, text, want) in enumerate(cases) if want is None
    ]
    assert {offset: got[offset][column] for offset, (column, _, want) in enumerate(cases) if want} == {
        offset: want for offset, (_, _, want) in enumerate(cases) if want
    }


def test_a_date_or_time_key_is_read_in_its_iso_form_only(spark: SparkSession) -> None:
    cfg = replica({"days": {"topic": "days", "keys": ["day"], "schema": "day DATE, n BIGINT"}})
    texts = {"2024-05-06": True, "20240506": False, "2024-05-06 garbage": False, "2024-05": False}
    rows = [
        record({"day": text}, {"op": "upsert", "data": {"day": text, "n": offset}}, offset, topic="days")
        for offset, text in enumerate(texts)
    ]
    changes_df = decode_table(spark, cfg, rows, "days")
    wrong = "key has a column of the wrong type (expected day date)"
    assert errors(changes_df) == [(offset, wrong) for offset, ok in enumerate(texts.values()) if not ok]
    assert [str(r["day"]) for r in decode.valid(changes_df).collect()] == ["2024-05-06"]


AT_TEXT = "2024-05-06T10:15:30.123456Z"


def test_a_debezium_date_or_time_without_a_logical_type_is_read_in_its_iso_form_only(spark: SparkSession) -> None:
    cfg = replica({"events": {**EVENTS, "schema": "id BIGINT, at TIMESTAMP, day DATE"}})
    rows = [
        record({"id": 1}, dbz("c", None, {"id": 1, "at": AT_TEXT, "day": "2024-05-06"}), 0, "dbz"),
        record({"id": 1}, dbz("c", None, {"id": 1, "at": "10:15:30"}), 1, "dbz"),
        record({"id": 1}, dbz("c", None, {"id": 1, "day": "2024-05-06 garbage"}), 2, "dbz"),
    ]
    changes_df = decode_table(spark, cfg, rows, "events")
    assert errors(changes_df) == [
        (1, _temporal_reason("at", "10:15:30")),
        (2, _temporal_reason("day", "2024-05-06 garbage")),
    ]
    (valid,) = decode.valid(changes_df).select(F.unix_micros("at").alias("at"), "day").collect()
    assert (valid["at"], str(valid["day"])) == (AT_MICROS, "2024-05-06")


@pytest.mark.parametrize("layout", ["one table", "two tables"])
def test_a_native_decimal_takes_numbers_and_strings_that_hold_one(spark: SparkSession, layout: str) -> None:
    """A DECIMAL takes a JSON number, or a string holding one exactly as JSON writes it (``"12.50"``: how Python's
    ``json.dumps(default=str)`` writes a ``Decimal``); Spark reads any other string too (``"1,234.5"`` as 1234.50,
    dropping commas), and such a record is quarantined, however its JSON is spaced or its field name escaped."""
    events = {"topic": "ev", "keys": ["id"], "schema": TEMPORAL_SCHEMA}
    tables = {"events": events} if layout == "one table" else {"events": events, "other": events}
    cfg = replica(tables)
    table = "" if layout == "one table" else '"table": "events", '

    def value(data: str) -> bytes:  # a digit at the 9th character, where a field name not found would be read
        return ('{"seq":12, "op": "upsert", ' + table + '"data": {"id": 1, ' + data + "}}").encode()

    texts = [
        ('"amount": 12.5', "12.50"),
        ('"amount":-3', "-3.00"),
        ('"amount":  7', "7.00"),
        ('"amount": "12.50"', "12.50"),
        ('"amount":"-1e2"', "-100.00"),
        ('"amo\\u0075nt": "12.50"', "12.50"),
        ('"amount":"1,234.5"', None),
        ('"amount": "12.5 "', None),
        ('"amount": "+5"', None),
        ('"amount":\t".5"', None),
        ('"amo\\u0075nt": "1,2"', None),
        ('"amount" : "1,5"', None),
    ]
    rows = [record({"id": 1}, value(data), offset, topic="ev") for offset, (data, _) in enumerate(texts)]
    changes_df = decode_table(spark, cfg, rows, "events")
    wrong = "data does not match the table schema: amount (decimal(10,2))"
    assert errors(changes_df) == [(offset, wrong) for offset, (_, want) in enumerate(texts) if want is None]
    got = _as_text(changes_df)
    assert {offset: got[offset]["amount"] for offset in got} == {o: want for o, (_, want) in enumerate(texts) if want}


def decode_values(
    spark: SparkSession, layout: str, schema: str, values: list[tuple[str, str]]
) -> tuple[DataFrame, dict[str, str]]:
    """One upsert per (column, JSON text) of ``values``, at offsets 0, 1, …, into a table of ``schema`` on a topic of
    its own (``layout`` "one table": the typed path) or of two tables (the untyped path); the decoded changes, and
    each column's type as a reason names it."""
    events = {"topic": "ev", "keys": ["id"], "schema": schema}
    cfg = replica({"events": events} if layout == "one table" else {"events": events, "other": events})
    table = "" if layout == "one table" else '"table": "events", '

    def value(column: str, text: str) -> bytes:
        return ('{"seq": 1, "op": "upsert", ' + table + '"data": {"id": 1, "' + column + '": ' + text + "}}").encode()

    rows = [record({"id": 1}, value(column, text), offset, "ev") for offset, (column, text) in enumerate(values)]
    types = {f.name: f.dataType.simpleString() for f in table_schema(cfg.tables[0], "test.toml").data.fields}
    return decode_table(spark, cfg, rows, "events"), types


EXACT_SCHEMA = "id BIGINT, amount DECIMAL(10,2), big DECIMAL(38,20)"
BEYOND = "more fraction digits than its scale: it would be rounded"
#: A DECIMAL value as JSON text, and the value it is kept as (None: refused, with the reason's words).
EXACT_TEXTS = [
    ("amount", "12.5", "12.50"),
    ("amount", "12.500", "12.50"),  # zeros beyond the scale change nothing
    ("amount", "-0.000", "0.00"),
    ("amount", "1.25e1", "12.50"),
    ("amount", "1200e-2", "12.00"),
    ("amount", '"1.2300E+1"', "12.30"),
    ("amount", "12.345", None),  # Spark: 12.35
    ("amount", "12.3450", None),
    ("amount", '"12.345"', None),
    ("amount", "1E-7", None),  # Spark: 0.00
    ("amount", "1.2345e1", None),
    ("amount", '"-5e-3"', None),
    ("big", "1.00000000000000000001", "1.00000000000000000001"),  # beyond a double's 17 digits
    ("big", "123456789012345678.12345678901234567891", "123456789012345678.12345678901234567891"),
    ("big", '"0.00000000000000000001"', "0.00000000000000000001"),
    ("big", "1.000000000000000000001", None),  # Spark: 1.00000000000000000000
    ("amo\\u0075nt", "12.345", None),  # a name written with an escape: not a plain record, read strictly
    ("amo\\u0075nt", "12.340", "12.34"),
]


@pytest.mark.parametrize("layout", ["one table", "two tables"])
def test_a_native_decimal_is_kept_exactly_or_refused(spark: SparkSession, layout: str) -> None:
    """A DECIMAL value is the number sent, to its last digit, or the record is quarantined: Spark rounds one with
    more fraction digits than the column's scale to the scale, and an untyped read goes through a double, which keeps
    17 digits; on the typed path of a one-table topic (plain records: without a strict parse) and the untyped path of
    two tables."""
    changes_df, types = decode_values(spark, layout, EXACT_SCHEMA, [(c, text) for c, text, _ in EXACT_TEXTS])
    named = [(column.replace("\\u0075", "u"), want) for column, _, want in EXACT_TEXTS]
    assert errors(changes_df) == [
        (offset, f"data does not match the table schema: {column} ({types[column]}, {BEYOND})")
        for offset, (column, want) in enumerate(named)
        if want is None
    ]
    columns = [F.col(c).cast("string").alias(c) for c in types]
    got = {r["_offset"]: r for r in decode.valid(changes_df).select("_offset", *columns).collect()}
    assert {offset: got[offset][column] for offset, (column, want) in enumerate(named) if want} == {
        offset: want for offset, (_, want) in enumerate(named) if want
    }


#: A TINYINT value as JSON text, and the value it is kept as (None: refused). Spark's reader (Jackson's
#: ``getByteValue``) takes 128..255 as -128..-1, a byte's bits.
TINY_TEXTS = [("0", 0), ("127", 127), ("-1", -1), ("-128", -128), ("128", None), ("200", None), ("255", None)]
TINY_TEXTS += [("-129", None), ("256", None)]


@pytest.mark.parametrize("layout", ["one table", "two tables"])
def test_a_tinyint_is_kept_in_its_range_or_refused(spark: SparkSession, layout: str) -> None:
    changes_df, _ = decode_values(spark, layout, "id BIGINT, code TINYINT", [("code", text) for text, _ in TINY_TEXTS])
    assert errors(changes_df) == [
        (o, "data does not match the table schema: code (tinyint)")
        for o, (_, want) in enumerate(TINY_TEXTS)
        if want is None
    ]
    got = {r["_offset"]: r["code"] for r in decode.valid(changes_df).collect()}
    assert got == {o: want for o, (_, want) in enumerate(TINY_TEXTS) if want is not None}


def test_a_tinyint_key_and_a_debezium_tinyint_are_kept_in_their_range_or_refused(spark: SparkSession) -> None:
    cfg = replica({"t": {"topic": "t", "keys": ["k"], "schema": "k TINYINT, v BIGINT"}})
    rows = [
        record(('{"k": ' + text + "}").encode(), b'{"op": "delete"}', o, "t") for o, (text, _) in enumerate(TINY_TEXTS)
    ]
    changes_df = decode_table(spark, cfg, rows, "t")
    assert errors(changes_df) == [
        (o, "key has a column of the wrong type (expected k tinyint)")
        for o, (_, want) in enumerate(TINY_TEXTS)
        if want is None
    ]
    assert {r["_offset"]: r["k"] for r in decode.valid(changes_df).collect()} == {
        o: want for o, (_, want) in enumerate(TINY_TEXTS) if want is not None
    }
    debezium = replica({"events": {**EVENTS, "schema": "id BIGINT, code TINYINT"}})
    rows = [record({"id": 1}, dbz("c", None, {"id": 1, "code": code}), o, "dbz") for o, code in enumerate((-56, 200))]
    changes_df = decode_table(spark, debezium, rows, "events")
    assert errors(changes_df) == [(1, "data does not match the table schema: code (tinyint)")]
    assert [r["code"] for r in decode.valid(changes_df).collect()] == [-56]


def test_a_decimal_key_is_kept_exactly_or_refused(spark: SparkSession) -> None:
    """Two keys that differ beyond the key column's scale would be one row; such a key is refused instead."""
    cfg = replica({"t": {"topic": "t", "keys": ["k"], "schema": "k DECIMAL(10,2), v BIGINT"}})
    texts = [("1.25", "1.25"), ("1.250", "1.25"), ("1.251", None), ('"1.259"', None), ("125e-2", "1.25")]
    texts += [('"1.25"', "1.25"), ('"1,234.50"', None), ('"+5"', None)]  # Spark: 1234.50 and 5.00
    rows = [
        record(('{"k": ' + text + "}").encode(), (b'{"op": "upsert", "data": {"k": 1.25, "v": 1}}'), o, "t")
        for o, (text, _) in enumerate(texts)
    ]
    changes_df = decode_table(spark, cfg, rows, "t")
    assert errors(changes_df) == [
        (o, "key has a column of the wrong type (expected k decimal(10,2))")
        for o, (_, want) in enumerate(texts)
        if not want
    ]
    got = {
        r["_offset"]: r["k"] for r in decode.valid(changes_df).select("_offset", F.col("k").cast("string")).collect()
    }
    assert got == {o: want for o, (_, want) in enumerate(texts) if want}


NESTED_SCHEMA = (
    "id BIGINT, tags ARRAY<STRING>, days ARRAY<DATE>, at ARRAY<TIMESTAMP>, attrs MAP<STRING, STRING>, "
    "prices MAP<STRING, DECIMAL(5,2)>, point STRUCT<x: DOUBLE, y: FLOAT, n: INT, ok: BOOLEAN>, "
    "deep ARRAY<STRUCT<d: ARRAY<DATE>, m: MAP<STRING, STRING>>>, "
    "exact ARRAY<STRUCT<q: DECIMAL(38,18), n: INT, s: STRING>>"
)
#: Values nested in ARRAY, MAP and STRUCT columns, as JSON text, and each one's value as Spark writes it as a string
#: (None: refused). Spark's reader takes every refused one but those marked.
NESTED_TEXTS = [
    ("tags", '["ok", null, "5", ""]', "[ok, null, 5, ]"),
    ("tags", "[1, true]", None),  # Spark: ["1", "true"]
    ("tags", '[{"a": 1}]', None),  # Spark: ['{"a":1}']
    ("days", '["2024-05-06", null]', "[2024-05-06, null]"),
    ("days", '["20240506"]', None),  # Spark: the year 57386
    ("days", '["2024-05-06 junk"]', None),  # Spark: 2024-05-06
    ("days", "[19000]", None),  # (Spark refuses it too)
    ("at", '["2024-05-06T10:15:30.123456+02:00"]', "[2024-05-06 08:15:30.123456]"),
    ("at", '["10:15:30"]', None),  # Spark: today at 10:15:30
    ("at", "[1700000000]", None),  # Spark: seconds
    ("attrs", '{"a": "1", "b": null}', "{a -> 1, b -> null}"),
    ("attrs", '{"a": 1}', None),  # Spark: "1"
    ("prices", '{"a": "12.5", "b": 7}', "{a -> 12.50, b -> 7.00}"),
    ("prices", '{"a": "+5"}', None),  # Spark: 5.00
    ("prices", '{"a": 12.345}', None),  # Spark: 12.35
    ("prices", '{"a": "0.001", "b": 1}', None),  # Spark: 0.00
    ("prices", '{"a": 12.340, "b": "1e1"}', "{a -> 12.34, b -> 10.00}"),
    ("point", '{"x": 1, "y": -1.5, "n": 7, "ok": true, "extra": [1]}', "{1.0, -1.5, 7, true}"),
    ("point", '{"y": 1e300}', None),  # Spark: infinity
    ("point", '{"x": 1e400}', None),
    ("point", '{"n": 1.0}', None),  # (Spark refuses it too)
    ("point", '{"ok": "true"}', None),  # (Spark refuses it too)
    ("deep", '[{"d": ["2024-05-06", null], "m": {"x": "y"}}, null]', "[{[2024-05-06, null], {x -> y}}, null]"),
    ("deep", '[{"d": ["2024-05-06"]}, {"m": {"x": 5}}]', None),  # Spark: "5"
    ("deep", '[{"d": ["2024"]}]', None),  # Spark: 2024-01-01
    # Spark: 1.000000000000000000 off a topic of two tables (its text of the row writes a double's 17 digits)
    (
        "exact",
        '[{"q": 1.000000000000000001, "n": 2, "s": "x", "extra": 1}, {"q": "-2.5"}]',
        "[{1.000000000000000001, 2, x}, {-2.500000000000000000, null, null}]",
    ),
]


@pytest.mark.parametrize("layout", ["one table", "two tables"])
def test_values_nested_in_arrays_maps_and_structs_take_the_contract_s_types(spark: SparkSession, layout: str) -> None:
    """The contract's types hold at any depth: Spark's reader takes a number into a nested STRING, eight digits into
    a nested DATE as a far-off year, a time of day into a nested TIMESTAMP as today; each such record is quarantined
    with the column and its type, on the typed path of a one-table topic and the untyped path of two tables."""
    changes_df, types = decode_values(spark, layout, NESTED_SCHEMA, [(c, text) for c, text, _ in NESTED_TEXTS])
    assert errors(changes_df) == [
        (offset, f"data does not match the table schema: {column} ({types[column]})")
        for offset, (column, _, want) in enumerate(NESTED_TEXTS)
        if want is None
    ]
    columns = [F.col(c).cast("string").alias(c) for c in types]
    got = {r["_offset"]: r for r in decode.valid(changes_df).select("_offset", *columns).collect()}
    assert {offset: got[offset][column] for offset, (column, _, want) in enumerate(NESTED_TEXTS) if want} == {
        offset: want for offset, (_, _, want) in enumerate(NESTED_TEXTS) if want
    }


@pytest.mark.parametrize("layout", ["one table", "two tables"])
def test_a_column_named_with_a_dot_or_a_bracket_is_checked_as_one_field(spark: SparkSession, layout: str) -> None:
    """A JSON path ``$.a.b`` names a field b inside a: the checks look a column up by its whole name."""
    odd = {"topic": "ev", "keys": ["id"], "schema": "id BIGINT, `a.b` DATE, `c[0]` DOUBLE, `d.e` DECIMAL(5,2)"}
    cfg = replica({"odd": odd} if layout == "one table" else {"odd": odd, "other": odd})
    table = {} if layout == "one table" else {"table": "odd"}
    texts = [("a.b", "2024-05-06"), ("a.b", "20240506"), ("c[0]", 1.5), ("c[0]", "1.5"), ("d.e", "+5"), ("d.e", "5")]
    rows = [
        record({"id": 1}, {"op": "upsert", **table, "data": {"id": 1, column: value}}, offset, "ev")
        for offset, (column, value) in enumerate(texts)
    ]
    changes_df = decode_table(spark, cfg, rows, "odd")
    assert errors(changes_df) == [
        (
            1,
            "data does not match the table schema: a.b (date, a number with no unit: send a string such as 2024-05-06)",
        ),
        (3, "data does not match the table schema: c[0] (double)"),
        (4, "data does not match the table schema: d.e (decimal(5,2))"),
    ]
    got = decode.valid(changes_df).select("_offset", *[F.col(f"`{c}`").cast("string") for c in ("a.b", "c[0]", "d.e")])
    assert sorted(tuple(r) for r in got.collect()) == [
        (0, "2024-05-06", None, None),
        (2, None, "1.5", None),
        (5, None, None, "5.00"),
    ]


@pytest.mark.parametrize("layout", ["one table", "two tables"])
def test_an_upsert_without_a_value_for_a_not_null_column_is_refused(spark: SparkSession, layout: str) -> None:
    """A column kept NOT NULL must have a value in every upsert (the table would refuse the batch); one the table
    leaves out is not asked for, and a delete carries no row."""
    schema = "id BIGINT, a STRING NOT NULL, b BIGINT NOT NULL, c STRING NOT NULL"
    spec = {"topic": "ev", "keys": ["id"], "schema": schema, "exclude_columns": ["c"]}
    cfg = replica({"t": spec} if layout == "one table" else {"t": spec, "other": spec})
    table = {} if layout == "one table" else {"table": "t"}
    rows = [
        record({"id": 1}, {"op": "upsert", **table, "data": {"id": 1, "a": "x", "b": 2}}, 0, "ev"),
        record({"id": 1}, {"op": "upsert", **table, "data": {"id": 1, "a": None, "b": 2, "c": "z"}}, 1, "ev"),
        record({"id": 1}, {"op": "upsert", **table, "data": {"id": 1}}, 2, "ev"),
        record({"id": 1}, {"op": "delete", **table}, 3, "ev"),
        record({"id": 1}, {"op": "upsert", **table, "data": {"id": 1, "a": "x", "b": "2"}}, 4, "ev"),
    ]
    changes_df = decode_table(spark, cfg, rows, "t")
    assert errors(changes_df) == [
        (1, "data has no value for NOT NULL column a"),
        (2, "data has no value for NOT NULL column a, b"),
        (4, "data does not match the table schema: b (bigint)"),  # a value of another type, not a missing one
    ]
    assert offsets(decode.valid(changes_df)) == [0, 3]


def test_values_nested_in_a_debezium_row_take_the_contract_s_types(spark: SparkSession) -> None:
    cfg = replica({"events": {**EVENTS, "schema": "id BIGINT, tags ARRAY<STRING>"}})
    rows = [
        record({"id": 1}, dbz("c", None, {"id": 1, "tags": ["a", None]}), 0, "dbz"),
        record({"id": 1}, dbz("c", None, {"id": 1, "tags": ["a", 5]}), 1, "dbz"),
    ]
    changes_df = decode_table(spark, cfg, rows, "events")
    assert errors(changes_df) == [(1, "data does not match the table schema: tags (array<string>)")]
    assert [r["tags"] for r in decode.valid(changes_df).collect()] == [["a", None]]


def with_item_schema(payload: dict[str, Any], **items: tuple[str, str | None, dict[str, str] | None]) -> dict[str, Any]:
    """:func:`with_schema` for ARRAY columns whose items have a (type, logical name, parameters), as Debezium sends a
    PostgreSQL ``date[]`` or ``numeric(10,2)[]``."""
    wrapped = with_schema(payload, **{name: ("array", None, None) for name in items})
    for image in wrapped["schema"]["fields"][:2]:
        for field in image["fields"]:
            if field["field"] in items:
                kind, name, parameters = items[field["field"]]
                field["items"] = {"type": kind, "optional": True}
                field["items"].update({"name": name} if name else {})
                field["items"].update({"parameters": parameters} if parameters else {})
    return wrapped


def test_the_elements_of_a_debezium_array_are_converted_by_their_logical_type(spark: SparkSession) -> None:
    schema = (
        "id BIGINT, days ARRAY<DATE>, ats ARRAY<TIMESTAMP>, locals ARRAY<TIMESTAMP_NTZ>, prices ARRAY<DECIMAL(10,2)>, "
        "ratios ARRAY<DECIMAL(20,5)>, times ARRAY<STRING>, tags ARRAY<STRING>"
    )
    cfg = replica({"events": {**EVENTS, "schema": schema}})
    units = {
        "days": ("int32", "io.debezium.time.Date", None),
        "ats": ("int64", "io.debezium.time.NanoTimestamp", None),
        "locals": MICRO,
        "prices": DECIMAL_2,
        "ratios": ("struct", "io.debezium.data.VariableScaleDecimal", None),
        "times": ("int64", "io.debezium.time.MicroTime", None),
        "tags": ("string", None, None),
    }
    row: dict[str, Any] = {name: None for name in units}
    noon = 12 * 3_600_000_000

    def change(i: int, values: dict[str, Any], schema_sent: bool = True) -> RawRow:
        payload = dbz("c", None, {**row, "id": i, **values})
        return record({"id": i}, with_item_schema(payload, **units) if schema_sent else payload, i - 1, "dbz")

    rows = [
        change(
            1,
            {
                "days": [DAY_COUNT, None, 0],
                "ats": [AT_MICROS * 1000],
                "locals": [AT_MICROS, -1],
                "prices": [unscaled(12345), None, unscaled(-5)],
                "ratios": [{"scale": 3, "value": unscaled(-1234567)}, {"scale": 0, "value": unscaled(2)}],
                "times": [noon, 86_400_000_000],
                "tags": ["a", None],
            },
        ),
        change(2, {"days": [], "prices": []}),
        # Refused: one element not exact (finer than microseconds, past the scale, out of a day or of DATE's range),
        # a day sent as text where the schema says a count, a number with no unit, a tag that is not a string.
        change(3, {"ats": [AT_MICROS * 1000, AT_MICROS * 1000 + 1]}),
        change(4, {"prices": [unscaled(1), unscaled(10**12)]}),
        change(5, {"ratios": [{"scale": 6, "value": unscaled(1234567)}]}),
        change(6, {"times": [noon, -1]}),
        change(7, {"days": [10**9]}),
        change(8, {"days": ["2024-05-06"]}),
        change(9, {"days": [DAY_COUNT]}, schema_sent=False),
        change(10, {"tags": ["a", 5]}),
    ]
    changes_df = decode_table(spark, cfg, rows, "events")

    mismatch = "data does not match the table schema"
    assert errors(changes_df) == [
        (2, f"{mismatch}: ats (array<timestamp>)"),
        (3, f"{mismatch}: prices (array<decimal(10,2)>)"),
        (4, f"{mismatch}: ratios (array<decimal(20,5)>)"),
        (5, f"{mismatch}: times (array<string>)"),
        (6, f"{mismatch}: days (array<date>)"),
        (7, f"{mismatch}: days (array<date>)"),
        (8, f"{mismatch}: days (array<date>)"),
        (9, f"{mismatch}: tags (array<string>)"),
    ]
    got = {r["id"]: r for r in decode.valid(changes_df).collect()}
    assert sorted(got) == [1, 2]
    first = got[1]
    assert [str(d) for d in first["days"]] == ["2024-05-06", "None", "1970-01-01"]
    assert first["ats"] == [datetime(2024, 5, 6, 10, 15, 30, 123456)]  # the session's time zone is UTC
    assert first["locals"] == [AT, datetime(1969, 12, 31, 23, 59, 59, 999999)]
    assert [str(p) for p in first["prices"]] == ["123.45", "None", "-0.05"]
    assert [str(r) for r in first["ratios"]] == ["-1234.56700", "2.00000"]
    assert first["times"] == ["12:00:00.000000", "24:00:00.000000"]
    assert first["tags"] == ["a", None]
    assert (got[2]["days"], got[2]["prices"], got[2]["ats"]) == ([], [], None)


def test_the_producer_s_python_values_decode_exactly(spark: SparkSession) -> None:
    """What ``replica_lib.producer`` writes for Python's ``Decimal``, ``date`` and ``datetime`` (``str`` of each) is
    of the contract's forms, so it decodes to the same values: the rules above must not refuse our own producer."""
    cfg = replica({"events": {"topic": "ev", "keys": ["id"], "schema": TEMPORAL_SCHEMA}})
    paris = timezone(timedelta(hours=2))
    rows_in = [
        {"id": 1, "amount": Decimal("12.50"), "day": date(2024, 5, 6), "at": AT.replace(tzinfo=UTC)},
        {"id": 2, "amount": Decimal("-0.01"), "at": AT.replace(tzinfo=paris), "local": AT},
        {
            "id": 3,
            "amount": Decimal("7"),
            "at": AT.replace(microsecond=0, tzinfo=UTC),
            "local": AT.replace(microsecond=0),
        },
    ]
    rows = [
        (
            bytearray(encode_key({"id": r["id"]})),
            bytearray(encode_value(Change(key={"id": r["id"]}, data=r)) or b""),
            "ev",
            0,
            i,
            KAFKA_TS,
        )
        for i, r in enumerate(rows_in)
    ]
    changes_df = decode_table(spark, cfg, rows, "events")
    assert errors(changes_df) == []
    got = (
        decode.valid(changes_df)
        .orderBy("_offset")
        .select("id", "amount", "day", F.unix_micros("at").alias("at"), F.col("local").cast("string").alias("local"))
    )
    assert [tuple(r) for r in got.collect()] == [
        (1, Decimal("12.50"), date(2024, 5, 6), AT_MICROS, None),
        (2, Decimal("-0.01"), None, AT_MICROS - 2 * 3600 * 1_000_000, "2024-05-06 10:15:30.123456"),
        (3, Decimal("7.00"), None, AT_MICROS - 123456, "2024-05-06 10:15:30"),
    ]


# ---------------------------------------------------------------------------------------------- never fatal
def test_numbers_spark_would_fail_the_batch_on_are_refused_records(spark: SparkSession) -> None:
    """An event time beyond a timestamp's range, a sequence beyond BIGINT's or a Debezium field that is not a whole
    number made Spark's casts fail the decode's job, so the replica stopped at the record on every restart: each is
    now a quarantined record, and the records beside it decode."""
    native = replica({"t": {"topic": "t", "keys": ["id"], "sequence_by": "v", "schema": "id BIGINT, v DECIMAL(38,0)"}})
    not_a_time = "is not a time in milliseconds between 0001-01-01 and 9999-12-31"
    native_rows = [
        record({"id": 1}, {"op": "upsert", "data": {"id": 1, "v": 5}}, 0, topic="t"),
        record({"id": 1}, {"op": "upsert", "data": {"id": 1, "v": 10**30}}, 1, topic="t"),
        *[
            record({"id": 1}, {"op": "upsert", "ts_ms": ms, "data": {"id": 1, "v": 6}}, offset, topic="t")
            for offset, ms in ((2, 10**17), (3, 2**63 - 1), (4, -(2**63)), (5, 253_402_300_799_999))
        ],
    ]
    native_df = decode_table(spark, native, native_rows, "t")
    assert errors(native_df) == [
        (1, "sequence v is beyond BIGINT's range (the table is ordered by it as a BIGINT)"),
        (2, f"envelope's ts_ms {not_a_time}"),
        (3, f"envelope's ts_ms {not_a_time}"),
        (4, f"envelope's ts_ms {not_a_time}"),
    ]
    valid = decode.valid(native_df).select("_offset", "_seq", F.col("_event_ts").cast("string").alias("at"))
    assert [tuple(r) for r in valid.orderBy("_offset").collect()] == [(0, 5, None), (5, 6, "9999-12-31 23:59:59.999")]

    dbz_cfg = replica({"events": {**EVENTS, "sequence_by": "source.lsn"}})
    base: dict[str, Any] = {"before": None, "after": {"id": 1}, "op": "c", "ts_ms": 1}
    payloads: list[tuple[dict[str, Any], str | None]] = [
        ({**base, "source": {"ts_ms": 2, "lsn": 7}}, None),
        ({**base, "source": {"ts_ms": "2", "lsn": 7}}, None),  # a string of a whole number, as get_json_object reads
        ({**base, "source": {"ts_ms": "abc", "lsn": 7}}, "Debezium source.ts_ms is not a whole number"),
        ({**base, "source": {"ts_ms": 1.5, "lsn": 7}}, "Debezium source.ts_ms is not a whole number"),
        ({**base, "source": {"ts_ms": 10**17, "lsn": 7}}, f"Debezium ts_ms {not_a_time}"),
        ({**base, "ts_ms": 10**17, "source": {"lsn": 7}}, f"Debezium ts_ms {not_a_time}"),
        *[
            (
                {**base, "source": {"ts_ms": 2, "lsn": lsn}},
                "Debezium source.lsn (the table's sequence) is not a whole number of BIGINT's range",
            )
            for lsn in ("abc", 1.5, 10**30, True, {"a": 1})
        ],
    ]
    dbz_rows = [record({"id": 1}, payload, offset, topic="dbz") for offset, (payload, _) in enumerate(payloads)]
    dbz_df = decode_table(spark, dbz_cfg, dbz_rows, "events")
    assert errors(dbz_df) == [(offset, why) for offset, (_, why) in enumerate(payloads) if why]
    assert [r["_seq"] for r in decode.valid(dbz_df).orderBy("_offset").collect()] == [7, 7]
