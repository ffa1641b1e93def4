"""The catalog and the SQL server as users run them: ./replica catalog register, ./replica serve, beeline.

One server for the module (it costs a JVM): replica ``served_a`` (copy-on-write) is given to the server, which
registers it on start; replica ``served_b`` (merge-on-read, nothing folded, so its state is its view's ranking) is
registered first by a ``./replica catalog register`` of its own, a process that ends before the server starts: the
server's session sees the names that one left in the catalog.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_dev.model import LoggedChange, fold
from replica_lib.catalog import metastore_holder, pending
from replica_lib.config import PROJECT_ROOT, ReplicaConfig, load_replica, local_settings
from replica_lib.server import BeelineResult, beeline, running_server
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import delete, produce, produce_garbage, run_available_now, tombstone, upsert

pytestmark = pytest.mark.integration

COLUMNS = ["order_id", "customer", "amount", "status", "updated_ms"]
START_TIMEOUT_S = 300.0


@dataclass
class Served:
    url: str
    catalog_dir: Path
    env: dict[str, str]
    a: ReplicaConfig
    b: ReplicaConfig
    b_conf: Path
    a_conf: Path
    log: list[LoggedChange]
    garbage_offset: int


def _run(args: list[str], env: dict[str, str], timeout_s: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _changes() -> list[Any]:
    """Duplicates, out-of-order seqs, deletes, a late delete, a tombstone and a key deleted then written again."""
    return [
        upsert(1, 1, "new"),
        upsert(2, 1, "new"),
        upsert(1, 3, "paid"),
        upsert(1, 2, "late"),  # older than seq 3: loses
        upsert(1, 3, "paid"),  # a duplicate
        delete(2, 2),
        upsert(3, 1, "new", amount=12.5),
        upsert(4, 5, "shipped"),
        delete(4, 4),  # a late delete: loses to seq 5
        upsert(5, 1, "new"),
        tombstone(5),
        upsert(6, 1, "new"),
        delete(6, 2),
        upsert(6, 3, "back", amount=7.25),
    ]


@pytest.fixture(scope="module")
def served(spark: SparkSession, kafka: EmbeddedKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served")
    catalog_dir = root / "catalog"
    connection = {"bootstrap.servers": kafka.bootstrap_servers}
    topic = "served-orders"
    TopicAdmin(connection).ensure(TopicSpec.local(topic, partitions=2), local=True)
    log = produce(connection, topic, _changes())
    garbage_offset = produce_garbage(connection, topic, 0)

    docs = {
        "served_a": replica_doc("served_a", root / "a", kafka.bootstrap_servers, {"orders": orders_table(topic)}),
        "served_b": replica_doc(
            "served_b",
            root / "b",
            kafka.bootstrap_servers,
            {"orders": orders_table(topic, layout="merge-on-read", fold_every_batches=0)},
        ),
    }
    confs = {name: write_replica(root / f"{name}.toml", doc) for name, doc in docs.items()}
    env = {**os.environ, "REPLICA_CATALOG_DIR": str(catalog_dir)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REPLICA_CATALOG_DIR", str(catalog_dir))
        b = load_replica(confs["served_b"])
        run_available_now(spark, b)  # leaves its names for the catalog's holder, ./replica catalog register here
        assert [p.name.endswith("-served_b.json") for p in pending(local_settings())] == [True]
        register_b = subprocess.Popen(
            [str(PROJECT_ROOT / "replica"), "catalog", "register", str(confs["served_b"])],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        patch.setenv("REPLICA_CATALOG_DIR", str(root / "elsewhere"))
        a = load_replica(confs["served_a"])
        run_available_now(spark, a)  # meanwhile; leaves its names elsewhere: the server registers it on start
    out, err = register_b.communicate(timeout=START_TIMEOUT_S)
    assert register_b.returncode == 0, err[-3000:]
    assert "registered served_b.orders\n" in out
    assert pending(local_settings({**env})) == []

    log_path = root / "server.log"
    with log_path.open("w") as server_log:
        server = subprocess.Popen(
            [str(PROJECT_ROOT / "replica"), "serve", str(confs["served_a"]), "--port", "0"],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=server_log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    def lines() -> list[str]:
        return log_path.read_text().splitlines()

    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(line.startswith("SQL server ready: ") for line in lines()):
            assert server.poll() is None and time.monotonic() < deadline, "\n".join(lines()[-80:])
            time.sleep(0.2)  # waiting for the server's ready line, with a deadline
        url = next(line for line in lines() if line.startswith("SQL server ready: ")).split(": ", 1)[1].strip()
        yield Served(url, catalog_dir, env, a, b, confs["served_b"], confs["served_a"], log, garbage_offset)
    finally:
        stopped = _run([str(PROJECT_ROOT / "replica"), "serve", "stop"], env, timeout_s=120)
        try:
            assert server.wait(timeout=120) == 0, "\n".join(lines()[-80:])
        finally:
            if server.poll() is None:
                server.kill()
    assert stopped.returncode == 0 and "stopped the SQL server" in stopped.stdout, (stopped, lines()[-80:])
    assert "SQL server stopped" in lines()
    assert running_server(local_settings(env)) is None
    assert not (catalog_dir / "sql-server.json").exists()
    assert not metastore_holder(local_settings(env))  # its JVM is gone, and Derby's lock with it


def _rows(result: BeelineResult) -> tuple[list[str], list[list[str]]]:
    """The header and the rows (sorted) of a beeline result in csv2."""
    assert result.error is None, result
    table = list(csv.reader(io.StringIO(result.output)))
    return table[0], sorted(table[1:], key=lambda row: [(len(cell), cell) for cell in row])


def _text(value: Any) -> str:
    return "NULL" if value is None else str(value)


def _expected(log: list[LoggedChange], columns: list[str]) -> list[list[str]]:
    rows = fold(log, {"orders": ("order_id",)}, {"orders": True})["orders"]
    return [[_text(row[c]) for c in columns] for _, row in sorted(rows.items())]


def test_replica_names_show_the_state_with_the_users_columns(served: Served) -> None:
    for replica in ("served_a", "served_b"):  # a: registered by the server; b: by another process before it
        header, rows = _rows(beeline(served.url, f"SELECT * FROM {replica}.orders", "csv2"))
        assert header == COLUMNS
        assert rows == _expected(served.log, COLUMNS)


def test_internal_names_keep_provenance_deletes_and_quarantine(served: Served) -> None:
    columns = ["order_id", "_src_partition", "_src_offset", "_src_seq"]
    header, rows = _rows(beeline(served.url, f"SELECT {', '.join(columns)} FROM served_a.orders__raw", "csv2"))
    assert (header, rows) == (columns, _expected(served.log, columns))
    _, deleted = _rows(beeline(served.url, "SELECT order_id FROM served_a.orders__deletes", "csv2"))
    assert deleted == [["2"], ["5"]]  # the deletes that won their key's batch (one batch: 4's and 6's lost)
    _, quarantined = _rows(beeline(served.url, "SELECT offset, topic FROM served_a.quarantine", "csv2"))
    assert quarantined == [[str(served.garbage_offset), "served-orders"]]
    _, names = _rows(beeline(served.url, "SHOW TABLES IN served_b", "csv2"))
    assert sorted(row[1] for row in names) == [
        "orders",
        "orders__changes",
        "orders__deletes",
        "orders__raw",
        "quarantine",
    ]


def test_sql_command_goes_through_the_server_and_says_bad_sql_in_one_line(served: Served) -> None:
    assert metastore_holder(local_settings(served.env))  # the server holds the local catalog: no one else opens it
    replica = str(PROJECT_ROOT / "replica")
    query = "SELECT order_id, status FROM orders WHERE order_id = 1"
    good = _run([replica, "sql", str(served.a_conf), query], served.env)
    assert good.returncode == 0, good.stderr[-3000:]
    assert "| 1         | paid    |" in good.stdout
    assert "Spark" not in good.stderr  # no session of its own: the server answered
    bad = _run([replica, "sql", "SELEC * FROM served_a.orders"], served.env)
    assert bad.returncode == 2
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: [PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'. SQLSTATE: 42601 (line 1, pos 0)"]
    assert "Traceback" not in bad.stderr and "\tat " not in bad.stderr
    missing = _run([replica, "sql", "SELECT * FROM served_a.nope"], served.env)
    assert missing.returncode == 2
    assert next(line for line in missing.stderr.splitlines() if line.startswith("error:")).startswith(
        "error: [TABLE_OR_VIEW_NOT_FOUND] The table or view `served_a`.`nope` cannot be found."
    )


def test_a_replica_starting_while_the_server_runs_registers_through_it(
    spark: SparkSession, served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert beeline(served.url, "DROP VIEW served_b.orders").error is None
    monkeypatch.setenv("REPLICA_CATALOG_DIR", str(served.catalog_dir))
    run_available_now(spark, served.b)  # nothing new in the log: it starts, leaves its names, and stops
    deadline = time.monotonic() + 60
    while pending(local_settings()):
        assert time.monotonic() < deadline, "the server did not take the replica's names"
        time.sleep(0.2)  # the server takes pending names every second
    _, rows = _rows(beeline(served.url, "SELECT * FROM served_b.orders", "csv2"))
    assert rows == _expected(served.log, COLUMNS)
