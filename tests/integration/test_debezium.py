"""Debezium's PostgreSQL connector on Kafka Connect, for real: a replica with ``format = "debezium"`` equals
PostgreSQL's ``SELECT *``, value for value.

One PostgreSQL server and one Connect worker per run (session fixtures), on the suite's broker and Spark session.
Each test captures a table of its own with a connector of its own (its own slot, publication and topic), configured
as the README's "Debezium settings" say.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from chispa import assert_df_equality
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_dev.embedded_kafka import EmbeddedKafka
from replica_dev.kafka_connect import KafkaConnect
from replica_dev.postgres import EmbeddedPostgres
from replica_lib.config import LocalSettings, ReplicaConfig
from replica_lib.logical import UNAVAILABLE
from replica_lib.target import read_table
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import replica_config, run_available_now

pytestmark = pytest.mark.integration

COLUMNS = ("a", "b", "ts", "tz", "amount", "d", "t", "body", "flag", "n")
DDL = (
    "a integer, b text, ts timestamp, tz timestamptz, amount numeric(12,2), d date, t time, body text, "
    "flag boolean, n bigint, PRIMARY KEY (a, b)"
)
#: The replica's schema for that table, as the README's "Debezium settings" say to declare it.
SCHEMA = (
    "a INT, b STRING, ts TIMESTAMP_NTZ, tz TIMESTAMP, amount DECIMAL(12,2), d DATE, t STRING, body STRING, "
    "flag BOOLEAN, n BIGINT"
)
#: A row whose ``body`` PostgreSQL stores out of line (TOASTed): random letters do not compress below 2 kB.
TOASTED_KEY = (0, "toast")
#: A statement, with its parameters or without.
Statement = str | tuple[str, Sequence[Any]]


@pytest.fixture(scope="session")
def postgres() -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres() as server:
        yield server


@pytest.fixture(scope="session")
def connect(
    kafka: EmbeddedKafka, settings: LocalSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KafkaConnect]:
    with KafkaConnect(
        tmp_path_factory.mktemp("connect"), settings.state_dir, kafka.bootstrap_servers, settings.java_home
    ) as worker:
        yield worker


def execute(postgres: EmbeddedPostgres, statements: Sequence[Statement]) -> int:
    """Run ``statements`` in one transaction; returns its transaction id."""
    with psycopg.connect(postgres.conninfo) as conn:
        row = conn.execute("SELECT txid_current()").fetchone()
        assert row is not None
        for statement in statements:
            query, params = (statement, ()) if isinstance(statement, str) else statement
            conn.execute(query, params)
    return int(row[0])


@dataclass
class Capture:
    """One table captured by one connector into one topic."""

    table: str
    topic: str
    connector: str
    postgres: EmbeddedPostgres
    connect: KafkaConnect

    def sql(self, statements: Sequence[Statement]) -> int:
        return execute(self.postgres, statements)

    def rows(self) -> list[tuple[Any, ...]]:
        """PostgreSQL's ``SELECT *`` of the table: the source of truth."""
        with psycopg.connect(self.postgres.conninfo) as conn:
            return conn.execute(f"SELECT * FROM {self.table}").fetchall()

    def wait_captured(self, xid: int) -> None:
        """Wait until every change up to transaction ``xid`` is in Kafka: the connector committed its offset.

        Connect commits a source offset only once the record it belongs to, and every record before it, is
        acknowledged by the broker; ``xid`` must be the last transaction written and change a row (one session
        writes them all, so transaction ids grow with the log).
        """
        self.connect.client.wait_offset(self.connector, lambda offset: int(offset.get("txId", -1)) >= xid)


def capture(postgres: EmbeddedPostgres, connect: KafkaConnect, kafka: EmbeddedKafka, table: str) -> Capture:
    """Start a connector on ``table`` (which exists) and wait until its snapshot is in Kafka."""
    prefix = f"pg{uuid.uuid4().hex[:8]}"
    topic = f"{prefix}.public.{table}"
    # One topic per table, created before the connector writes to it, compacted (README, "Debezium settings").
    TopicAdmin({"bootstrap.servers": kafka.bootstrap_servers}).ensure(TopicSpec.local(topic, partitions=3), local=True)
    connector = f"{table}-source"
    connect.client.put_connector(
        connector,
        {
            "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
            "tasks.max": "1",
            "plugin.name": "pgoutput",
            "database.hostname": "127.0.0.1",
            "database.port": str(postgres.port),
            "database.user": postgres.user,
            "database.password": "unused",  # trust authentication on loopback
            "database.dbname": postgres.database,
            "topic.prefix": prefix,
            "table.include.list": f"public.{table}",
            "slot.name": f"{prefix}_{table}",
            "publication.name": f"{prefix}_{table}",
            "publication.autocreate.mode": "filtered",
            "snapshot.mode": "initial",
            "decimal.handling.mode": "precise",
            "time.precision.mode": "adaptive",
            "key.converter": "org.apache.kafka.connect.json.JsonConverter",
            "key.converter.schemas.enable": "true",
            "value.converter": "org.apache.kafka.connect.json.JsonConverter",
            "value.converter.schemas.enable": "true",
        },
    )
    connect.client.wait_running(connector)
    connect.client.wait_offset(connector, lambda offset: bool(offset.get("snapshot_completed")))
    return Capture(table, topic, connector, postgres, connect)


def replica_of(tmp_path: Path, kafka: EmbeddedKafka, source: Capture, schema: str, **table: Any) -> ReplicaConfig:
    spec = {
        "topic": source.topic,
        "format": "debezium",
        "keys": ["a", "b"],
        "sequence_by": "source.lsn",
        "schema": schema,
        **table,
    }
    return replica_config(tmp_path, kafka.bootstrap_servers, f"dbz_{source.table}", {source.table: spec})


def time_text(value: time | None) -> str | None:
    """A PostgreSQL ``time`` as the replica keeps it (README: ``HH:MM:SS.ffffff``)."""
    return None if value is None else value.isoformat(timespec="microseconds")


def as_expected(spark: SparkSession, rows: list[tuple[Any, ...]], schema: str, time_column: int) -> DataFrame:
    """PostgreSQL's rows as a DataFrame of the replica's schema (a ``time`` as its text)."""
    data = [tuple(time_text(v) if i == time_column else v for i, v in enumerate(row)) for row in rows]
    return spark.createDataFrame(data, schema=schema)


def replica_rows(spark: SparkSession, cfg: ReplicaConfig, table: str, columns: Sequence[str]) -> DataFrame:
    return read_table(spark, cfg.table(table).target).select(*columns)


def assert_equal(actual_df: DataFrame, expected_df: DataFrame) -> None:
    assert_df_equality(actual_df, expected_df, ignore_row_order=True, ignore_nullable=True)


# ---------------------------------------------------------------------------------------------- random rows
def random_values(rng: random.Random) -> dict[str, Any]:
    """The non-key columns of a row, each null now and then; values at the types' precision (microseconds)."""

    def maybe(value: Any) -> Any:
        return None if rng.random() < 0.15 else value

    moment = datetime(2000, 1, 1) + timedelta(microseconds=rng.randrange(0, 40 * 365 * 86_400 * 10**6))
    return {
        "ts": maybe(moment),
        "tz": maybe(moment.replace(tzinfo=UTC) + timedelta(hours=rng.randrange(-12, 12))),
        "amount": maybe(Decimal(rng.randrange(-(10**12) + 1, 10**12)).scaleb(-2)),
        "d": maybe(date(1970, 1, 1) + timedelta(days=rng.randrange(-20_000, 40_000))),
        "t": maybe(
            time(rng.randrange(24), rng.randrange(60), rng.randrange(60), rng.choice([0, rng.randrange(10**6)]))
        ),
        "body": maybe("".join(rng.choices(string.ascii_letters + " é", k=rng.randrange(0, 40)))),
        "flag": maybe(rng.random() < 0.5),
        "n": maybe(rng.randrange(-(2**63), 2**63)),
    }


def insert(table: str, key: tuple[int, str], values: dict[str, Any]) -> tuple[str, Sequence[Any]]:
    columns = ["a", "b", *values]
    marks = ", ".join(["%s"] * len(columns))
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})", [*key, *values.values()]


def update(table: str, key: tuple[int, str], values: dict[str, Any]) -> tuple[str, Sequence[Any]]:
    sets = ", ".join(f"{c} = %s" for c in values)
    return f"UPDATE {table} SET {sets} WHERE a = %s AND b = %s", [*values.values(), *key]


def random_dml(table: str, rng: random.Random, live: set[tuple[int, str]], transactions: int) -> list[list[Statement]]:
    """Transactions of inserts, updates of some columns (NULLs too), deletes, key changes and re-inserts of deleted
    keys; ``live`` (the keys that exist) is kept up to date. The TOASTed row is never touched."""
    batches = []
    for _ in range(transactions):
        statements: list[Statement] = []
        for _ in range(rng.randrange(1, 6)):
            choice = rng.random()
            key = (rng.randrange(1, 40), rng.choice("xyz"))
            if key not in live:
                statements.append(insert(table, key, random_values(rng)))
                live.add(key)
                continue
            if choice < 0.5:
                values = random_values(rng)
                picked = rng.sample(sorted(values), rng.randrange(1, len(values) + 1))
                statements.append(update(table, key, {c: values[c] for c in picked}))
            elif choice < 0.75:
                statements.append((f"DELETE FROM {table} WHERE a = %s AND b = %s", key))
                live.discard(key)
            else:
                moved = (rng.randrange(40, 80), rng.choice("xyz"))
                if moved in live:
                    continue
                sets = "a = %s, b = %s"
                statements.append((f"UPDATE {table} SET {sets} WHERE a = %s AND b = %s", [*moved, *key]))
                live.discard(key)
                live.add(moved)
        batches.append(statements)
    return batches


# ---------------------------------------------------------------------------------------------- the tests
def test_a_debezium_replica_equals_postgres(
    spark: SparkSession,
    kafka: EmbeddedKafka,
    postgres: EmbeddedPostgres,
    connect: KafkaConnect,
    tmp_path: Path,
) -> None:
    rng = random.Random(20_240_506)
    table = "items"
    toasted = "".join(rng.choices(string.ascii_letters, k=20_000))
    live: set[tuple[int, str]] = set()
    before: list[Statement] = [f"CREATE TABLE {table} ({DDL})", f"ALTER TABLE {table} REPLICA IDENTITY DEFAULT"]
    before.append(insert(table, TOASTED_KEY, {**random_values(rng), "body": toasted}))
    for key in [(i, rng.choice("xyz")) for i in range(1, 30)]:
        if key not in live:
            before.append(insert(table, key, random_values(rng)))
            live.add(key)
    execute(postgres, before)  # existing rows: the connector's snapshot reads them (op "r")
    source = capture(postgres, connect, kafka, table)
    cfg = replica_of(tmp_path, kafka, source, SCHEMA)

    # Changes after the snapshot, then one that leaves the TOASTed body untouched.
    for batch in random_dml(table, rng, live, transactions=50):
        source.sql(batch)
    toasted_row = next(r for r in source.rows() if (r[0], r[1]) == TOASTED_KEY)
    last = source.sql([f"UPDATE {table} SET n = 12345, flag = NOT flag WHERE a = 0 AND b = 'toast'"])
    source.wait_captured(last)
    run_available_now(spark, cfg)

    # Debezium sends the untouched body as its placeholder: the change is quarantined, never stored, and the
    # replica keeps the row as it was before that change; every other row equals PostgreSQL's.
    quarantine = read_table(spark, cfg.quarantine).select("offset", "key", "reason").collect()
    assert [(r["key"] is not None, r["reason"]) for r in quarantine] == [
        (
            True,
            f"Debezium sent no value for body ('{UNAVAILABLE}': an unchanged TOASTed value; set REPLICA IDENTITY "
            "FULL on the source table, see the README's Debezium settings)",
        )
    ]
    assert b'"a":0,"b":"toast"' in quarantine[0]["key"]
    expected = [r if (r[0], r[1]) != TOASTED_KEY else toasted_row for r in source.rows()]
    assert_equal(replica_rows(spark, cfg, table, COLUMNS), as_expected(spark, expected, SCHEMA, COLUMNS.index("t")))
    assert replica_rows(spark, cfg, table, COLUMNS).where(F.col("body") == UNAVAILABLE).collect() == []


def test_a_column_added_to_the_postgres_table_mid_stream_reaches_the_replica(
    spark: SparkSession,
    kafka: EmbeddedKafka,
    postgres: EmbeddedPostgres,
    connect: KafkaConnect,
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    table = "evolving"
    live: set[tuple[int, str]] = set()
    first: list[Statement] = [f"CREATE TABLE {table} ({DDL})"]
    for key in [(i, "x") for i in range(1, 10)]:
        first.append(insert(table, key, random_values(rng)))
        live.add(key)
    execute(postgres, first)
    source = capture(postgres, connect, kafka, table)
    cfg = replica_of(tmp_path, kafka, source, SCHEMA, schema_evolution="add_columns")
    for statements in random_dml(table, rng, live, transactions=5):
        source.sql(statements)
    source.wait_captured(source.sql([insert(table, (97, "z"), random_values(rng))]))
    run_available_now(spark, cfg)

    # The column arrives with the next change that carries it: rows written before it hold null there.
    source.sql([f"ALTER TABLE {table} ADD COLUMN note text"])
    later: list[Statement] = []
    for i, key in enumerate(sorted(live)[:5]):
        later.append((f"UPDATE {table} SET note = %s WHERE a = %s AND b = %s", [f"note {i} ✓", *key]))
    later.append(insert(table, (99, "z"), {**random_values(rng), "note": None}))
    later.append(insert(table, (98, "z"), {**random_values(rng), "note": "new row"}))
    source.wait_captured(source.sql(later))
    run_available_now(spark, cfg)

    columns = (*COLUMNS, "note")
    assert_equal(
        replica_rows(spark, cfg, table, columns),
        as_expected(spark, source.rows(), f"{SCHEMA}, note STRING", COLUMNS.index("t")),
    )


def test_a_table_keyed_by_dates_and_times_equals_postgres(
    spark: SparkSession,
    kafka: EmbeddedKafka,
    postgres: EmbeddedPostgres,
    connect: KafkaConnect,
    tmp_path: Path,
) -> None:
    """A primary key of date and time columns (a partitioned table's key holds its partition column): Debezium sends
    them in the record key as days, microseconds and ISO text, with the key's Connect schema saying which."""
    rng = random.Random(11)
    table = "readings"
    schema = "d DATE, ts TIMESTAMP_NTZ, tz TIMESTAMP, a INT, v STRING"
    keys = [
        (
            date(2024, 5, 1) + timedelta(days=i % 3),
            datetime(2024, 5, 1, 10) + timedelta(microseconds=rng.randrange(10**12)),
            datetime(2024, 5, 1, tzinfo=UTC) + timedelta(microseconds=rng.randrange(10**12)),
            i,
        )
        for i in range(12)
    ]
    row = f"INSERT INTO {table} VALUES (%s, %s, %s, %s, %s)"
    where = "WHERE d = %s AND ts = %s AND tz = %s AND a = %s"
    ddl = "d date, ts timestamp, tz timestamptz, a integer, v text, PRIMARY KEY (d, ts, tz, a)"
    execute(postgres, [f"CREATE TABLE {table} ({ddl})", *[(row, [*k, f"v{i}"]) for i, k in enumerate(keys[:8])]])
    source = capture(postgres, connect, kafka, table)
    cfg = replica_of(tmp_path, kafka, source, schema, keys=["d", "ts", "tz", "a"])
    later: list[Statement] = [(row, [*k, f"v{i}"]) for i, k in enumerate(keys[8:], start=8)]
    later += [(f"UPDATE {table} SET v = %s {where}", [f"changed {i}", *keys[i]]) for i in (0, 1, 9)]
    later += [(f"DELETE FROM {table} {where}", list(keys[i])) for i in (2, 10)]
    source.wait_captured(source.sql(later))
    run_available_now(spark, cfg)

    assert read_table(spark, cfg.quarantine).count() == 0
    assert_equal(
        replica_rows(spark, cfg, table, ("d", "ts", "tz", "a", "v")),
        spark.createDataFrame(source.rows(), schema=schema),
    )


def test_a_table_of_arrays_of_dates_times_and_numerics_equals_postgres(
    spark: SparkSession,
    kafka: EmbeddedKafka,
    postgres: EmbeddedPostgres,
    connect: KafkaConnect,
    tmp_path: Path,
) -> None:
    """Debezium sends a ``date[]`` as day counts, a ``timestamp[]`` as microseconds, a ``numeric[]`` as base64
    unscaled values: each element by the logical type of the array's items in the record's schema."""
    rng = random.Random(13)
    table = "shelves"
    ddl = (
        "a integer, b text, days date[], stamps timestamp[], zoned timestamptz[], prices numeric(12,2)[], "
        "ratios numeric[], times time[], tags text[], PRIMARY KEY (a, b)"
    )
    schema = (
        "a INT, b STRING, days ARRAY<DATE>, stamps ARRAY<TIMESTAMP_NTZ>, zoned ARRAY<TIMESTAMP>, "
        "prices ARRAY<DECIMAL(12,2)>, ratios ARRAY<DECIMAL(20,6)>, times ARRAY<STRING>, tags ARRAY<STRING>"
    )
    columns = ("a", "b", "days", "stamps", "zoned", "prices", "ratios", "times", "tags")

    def arrays() -> dict[str, Any]:
        def some(make: Any) -> list[Any] | None:
            if rng.random() < 0.1:
                return None
            return [None if rng.random() < 0.15 else make() for _ in range(rng.randrange(0, 4))]

        values = random_values(rng)
        return {
            "days": some(lambda: date(1970, 1, 1) + timedelta(days=rng.randrange(-20_000, 40_000))),
            "stamps": some(lambda: datetime(2000, 1, 1) + timedelta(microseconds=rng.randrange(10**15))),
            "zoned": some(lambda: datetime(2000, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randrange(10**15))),
            "prices": some(lambda: Decimal(rng.randrange(-(10**12) + 1, 10**12)).scaleb(-2)),
            "ratios": some(lambda: Decimal(rng.randrange(-(10**9), 10**9)).scaleb(-rng.randrange(0, 7))),
            # Debezium 3.6.1 sends a time[]'s elements to the millisecond (as MicroTime): whole milliseconds here.
            "times": some(
                lambda: time(rng.randrange(24), rng.randrange(60), rng.randrange(60), rng.randrange(1000) * 1000)
            ),
            "tags": some(lambda: values["body"] or ""),
        }

    live = [(i, rng.choice("xy")) for i in range(1, 16)]
    execute(postgres, [f"CREATE TABLE {table} ({ddl})", *[insert(table, key, arrays()) for key in live[:10]]])
    source = capture(postgres, connect, kafka, table)
    cfg = replica_of(tmp_path, kafka, source, schema)
    later: list[Statement] = [insert(table, key, arrays()) for key in live[10:]]
    later += [update(table, key, arrays()) for key in live[::3]]
    later += [(f"DELETE FROM {table} WHERE a = %s AND b = %s", list(key)) for key in live[1::4]]
    source.wait_captured(source.sql(later))
    run_available_now(spark, cfg)

    assert read_table(spark, cfg.quarantine).count() == 0
    times = columns.index("times")
    expected = [
        tuple(
            [None if t is None else time_text(t) for t in v] if i == times and v is not None else v
            for i, v in enumerate(r)
        )
        for r in source.rows()
    ]
    assert_equal(replica_rows(spark, cfg, table, columns), spark.createDataFrame(expected, schema=schema))
