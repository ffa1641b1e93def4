"""A seeded fuzz of the decoder: valid changes mixed with every kind of malformed record (docs/contract.md).

Every bad record must be rejected, every valid one must decode to exactly its typed row, and nothing is lost.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_lib import decode
from tests.unit.test_decode import (
    KAFKA_TS,
    ORDERS,
    ORDERS_SCHEMA,
    RAW_SCHEMA,
    RawRow,
    replica,
    schemas_of,
)

# The decode's expressions run as in a replica job: with Spark's code generation (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("production_codegen")

SEED = 20261123
RECORDS = 2000
#: The typed columns of an orders change, then the change's op, seq, tombstone flag and offset.
EXPECTED_DDL = f"{ORDERS_SCHEMA}, _op STRING, _seq BIGINT, _tombstone BOOLEAN, _offset BIGINT"
# A string with a colon or a brace takes the strict parse (decode._plain_value); it is still a valid value.
TRICKY_STRINGS = ["ada", "5", "true", "-", "{x", "[1]", "a]b", '"quoted"', "é ü 漢", "back\\slash", "", "null"]
TRICKY_STRINGS += ["a:b", "x}{y", "k{"]


class Fuzz:
    """Generates one record at a time: valid changes (with their expected row) and malformed ones."""

    def __init__(self, seed: int, big: int = 1 << 20) -> None:
        self.rng = random.Random(seed)
        self.big = big  # the size of an oversized value (a broker takes about 1 MB per record)

    def dumps(self, obj: Any) -> bytes:
        rng = self.rng
        text = json.dumps(
            obj,
            separators=rng.choice([(",", ":"), (", ", ": ")]),
            indent=rng.choice([None, None, 2]),
            ensure_ascii=rng.random() < 0.5,
        )
        return (rng.choice(["", " ", "\n"]) + text + rng.choice(["", " ", "\n\t"])).encode()

    def key(self, order_id: int) -> bytes:
        return self.dumps({"order_id": order_id})

    def data(self, order_id: int) -> dict[str, Any]:
        rng = self.rng
        row: dict[str, Any] = {"order_id": order_id}
        for column, values in (
            ("customer", [None, *TRICKY_STRINGS]),
            ("amount", [None, 1.5, 2, -0.25, 1e10, 0]),
            ("status", [None, "new", "paid", "true", "7"]),
            ("updated_ms", [None, 0, 1_700_000_000_000, -5]),
        ):
            if rng.random() < 0.9:
                row[column] = rng.choice(values)
        if rng.random() < 0.1:
            row["note"] = "a field the schema does not have"
        items = list(row.items())
        rng.shuffle(items)
        return dict(items)

    def valid(self, offset: int) -> tuple[bytes | None, bytes | None, tuple[Any, ...]]:
        rng = self.rng
        order_id, seq = rng.randint(1, 50), rng.randint(1, 10_000)
        kind = rng.random()
        if kind < 0.1:
            return self.key(order_id), None, (order_id, None, None, None, None, "delete", None, True, offset)
        if kind < 0.3:
            envelope: dict[str, Any] = {"op": "delete", "seq": seq, "table": "orders"}
            if rng.random() < 0.5:
                envelope["data"] = None
            row = (order_id, None, None, None, None, "delete", seq, False, offset)
            return self.key(order_id), self.dumps(envelope), row
        data = self.data(order_id)
        if rng.random() < 0.005:
            data["customer"] = "x" * self.big
        envelope = {"op": "upsert", "seq": seq, "table": "orders", "ts_ms": 1_700_000_000_000, "data": data}
        amount = data.get("amount")
        typed = (
            order_id,
            data.get("customer"),
            None if amount is None else float(amount),
            data.get("status"),
            data.get("updated_ms"),
        )
        return self.key(order_id), self.dumps(envelope), (*typed, "upsert", seq, False, offset)

    def bad(self) -> tuple[bytes | None, bytes | None]:
        """A record that breaks the contract, of a randomly chosen kind."""
        rng = self.rng
        order_id, seq = rng.randint(1, 50), rng.randint(1, 10_000)
        key = self.key(order_id)
        envelope = {"op": "upsert", "seq": seq, "table": "orders", "data": self.data(order_id)}
        value = self.dumps(envelope)

        def data_with(text: str) -> bytes:
            head = f'{{"op": "upsert", "seq": {seq}, "table": "orders", "data": {{"order_id": {order_id}, '
            return (head + text + "}}").encode()

        def garbage() -> bytes:
            return bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))

        kinds: list[Callable[[], tuple[bytes | None, bytes | None]]] = [
            lambda: (key, value.replace(b'"op"', b'"\xff\xfe"', 1)),
            lambda: (b'{"order_id": ' + str(order_id).encode() + b', "x": "\xc3"}', value),
            lambda: (key, value + rng.choice([b" x", b"}", b"]", b"] x", b", 1", b" {}", value, b"\x00"])),
            lambda: (key + rng.choice([b" x", b"]", b'{"order_id": 1}']), value),
            lambda: (key, value.replace(b'"op"', b'"op": "delete", "op"', 1)),
            lambda: (key, data_with('"status": "a", "status": "b"')),
            lambda: (key, data_with('"status": null, "status": "a"')),
            lambda: (key, value.replace(b'"op"', b'"\\u006fp": "delete", "op"', 1)),
            lambda: (b'{"order_id": ' + str(order_id).encode() + b', "order_id": 1}', value),
            lambda: (key, value.replace(b'"', b"'")),
            lambda: (
                key,
                data_with('"amount": ' + rng.choice(["NaN", "Infinity", "-Infinity", "01", '"NaN"', "1e400"])),
            ),
            lambda: (
                key,
                data_with(rng.choice(['"customer": 5', '"status": true', '"customer": {"a": 1}', '"status": [1]'])),
            ),
            lambda: (key, data_with(rng.choice(['"updated_ms": 1.5', '"updated_ms": "5"', '"updated_ms": 1e30']))),
            lambda: (self.dumps({"order_id": order_id, "region": "eu"}), value),
            lambda: (key, data_with('"status": ' + "[" * 1100 + "]" * 1100)),
            lambda: (key, garbage()),
            lambda: (rng.choice([garbage(), b""]), value),
            lambda: (key, b""),
            lambda: (None, value),
            lambda: (key, rng.choice([b"[]", b"null", b'"upsert"', b"42", b'{"op": "upsert", "seq": 1, "data": [1]}'])),
            lambda: (
                key,
                b'{"op": "upsert", "seq": 1, "table": "orders", "data": {"order_id": 1, "amount": {"x": 1}}}',
            ),
            lambda: (key, self.dumps({"op": "upsert", "table": "orders", "data": self.data(order_id)})),
            lambda: (key, value + b"x" * self.big),
        ]
        return rng.choice(kinds)()


def fuzzed(seed: int, count: int) -> tuple[list[RawRow], list[tuple[Any, ...]], set[int]]:
    """``count`` records on one partition: (raw rows, expected typed rows of the valid ones, offsets of the bad)."""
    fuzz = Fuzz(seed)
    rows: list[RawRow] = []
    expected: list[tuple[Any, ...]] = []
    bad: set[int] = set()
    for offset in range(count):
        if fuzz.rng.random() < 0.6:
            key, value, row = fuzz.valid(offset)
            expected.append(row)
        else:
            key, value = fuzz.bad()
            bad.add(offset)
        as_bytes = [None if b is None else bytearray(b) for b in (key, value)]
        rows.append((as_bytes[0], as_bytes[1], "orders", 0, offset, KAFKA_TS))
    return rows, expected, bad


@pytest.mark.parametrize("layout", ["alone", "shared"])
def test_fuzzed_records_decode_exactly_or_are_rejected(spark: SparkSession, layout: str) -> None:
    """``alone``: a one-table topic (the single typed parse); ``shared``: two tables on the topic (two parses)."""
    tables: dict[str, dict[str, Any]] = {"orders": ORDERS}
    if layout == "shared":
        tables["payments"] = {"topic": "orders", "keys": ["payment_id"], "schema": "payment_id BIGINT, amount DOUBLE"}
    cfg = replica(tables)
    schemas = schemas_of(cfg)
    rows, expected, bad = fuzzed(SEED, RECORDS)
    if layout == "shared":  # a tombstone cannot name its table on a topic of several tables: rejected there
        bad |= {row[-1] for row in expected if row[7]}
        expected = [row for row in expected if not row[7]]

    env_df = decode.envelopes(spark.createDataFrame(rows, RAW_SCHEMA), cfg, schemas)
    changes_df = decode.table_changes(env_df, schemas["orders"], unrouted=True, alone=layout == "alone").cache()
    try:
        rejected = {
            r["_offset"]: r for r in decode.rejected(changes_df).select("_offset", "_key", "_value", "_error").collect()
        }
        assert set(rejected) == bad
        assert all(r["_error"] for r in rejected.values())
        # A rejected record keeps its raw bytes.
        assert all((r["_key"], r["_value"]) == (rows[offset][0], rows[offset][1]) for offset, r in rejected.items())
        actual_df = decode.valid(changes_df).select(
            *[c.split()[0] for c in ORDERS_SCHEMA.split(", ")], "_op", "_seq", "_tombstone", "_offset"
        )
        assert_df_equality(
            actual_df,
            spark.createDataFrame(expected, EXPECTED_DDL),
            ignore_row_order=True,
            ignore_nullable=True,
        )
        # Valid and rejected together are every record consumed, each once.
        assert changes_df.count() == len(rows) == len(expected) + len(bad)
        assert [tuple(r) for r in changes_df.select(F.countDistinct("_offset")).collect()] == [(len(rows),)]
    finally:
        changes_df.unpersist()
