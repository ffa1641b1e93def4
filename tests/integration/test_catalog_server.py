"""The catalog and the SQL server as users run them: ./replica catalog register, ./replica serve, beeline.

One server for the module (it costs a JVM), over the run's two replicas (``two_replicas``): ``served_b``
(merge-on-read, nothing folded, so its state is its view's ranking) is registered by a ``./replica catalog
register`` of its own, a process that ends before the server starts; ``served_a`` (copy-on-write) is given to the
server, which registers it on start and sees the names the other process left in the catalog.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from replica_dev.model import LoggedChange, fold
from replica_dev.polling import wait_for
from replica_lib.catalog import metastore_holder, pending
from replica_lib.config import PROJECT_ROOT, local_settings
from replica_lib.server import BeelineResult, beeline, running_server
from tests.integration.conftest import TwoReplicas
from tests.integration.support import run_available_now

pytestmark = pytest.mark.integration

COLUMNS = ["order_id", "customer", "amount", "status", "updated_ms"]
START_TIMEOUT_S = 300.0


@dataclass
class Served:
    url: str
    catalog_dir: Path
    env: dict[str, str]
    replicas: TwoReplicas


def _run(args: list[str], env: dict[str, str], timeout_s: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


@pytest.fixture(scope="module")
def served(two_replicas: TwoReplicas, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served")
    catalog_dir = root / "catalog"
    env = {**os.environ, "REPLICA_CATALOG_DIR": str(catalog_dir)}
    registered = _run([str(PROJECT_ROOT / "replica"), "catalog", "register", str(two_replicas.b_conf)], env)
    assert registered.returncode == 0, registered.stderr[-3000:]
    assert "registered served_b.orders\n" in registered.stdout
    assert not metastore_holder(local_settings(env))  # the command released the catalog before it returned

    log_path = root / "server.log"
    with log_path.open("w") as server_log:
        server = subprocess.Popen(
            [str(PROJECT_ROOT / "replica"), "serve", str(two_replicas.a_conf), "--port", "0"],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=server_log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    def lines() -> list[str]:
        return log_path.read_text().splitlines()

    def ready() -> bool:
        assert server.poll() is None, "\n".join(lines()[-80:])
        return any(line.startswith("SQL server ready: ") for line in lines())

    try:
        try:
            wait_for(ready, START_TIMEOUT_S, "the SQL server's ready line")
        except TimeoutError as exc:
            raise AssertionError("\n".join(lines()[-80:])) from exc
        url = next(line for line in lines() if line.startswith("SQL server ready: ")).split(": ", 1)[1].strip()
        yield Served(url, catalog_dir, env, two_replicas)
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


def _expected(log: list[LoggedChange], columns: list[str], live: bool = True) -> list[list[str]]:
    """The model's live rows (or, ``live=False``, the keys it left deleted) as beeline prints them."""
    rows = fold(log, {"orders": ("order_id",)}, {"orders": True})["orders"]
    if not live:
        keys = sorted({e.change.key["order_id"] for e in log} - {key[0] for key in rows})
        return [[str(key)] for key in keys]
    return [[_text(row[c]) for c in columns] for _, row in sorted(rows.items())]


def test_replica_names_show_the_state_with_the_users_columns(served: Served) -> None:
    for replica in ("served_a", "served_b"):  # a: registered by the server; b: by another process before it
        header, rows = _rows(beeline(served.url, f"SELECT * FROM {replica}.orders", "csv2"))
        assert header == COLUMNS
        assert rows == _expected(served.replicas.log, COLUMNS)


def test_internal_names_keep_provenance_deletes_and_quarantine(served: Served) -> None:
    columns = ["order_id", "_src_partition", "_src_offset", "_src_seq"]
    header, rows = _rows(beeline(served.url, f"SELECT {', '.join(columns)} FROM served_a.orders__raw", "csv2"))
    assert (header, rows) == (columns, _expected(served.replicas.log, columns))
    # Retained deletes: every key the log leaves deleted, each row a delete the log holds at that place.
    _, deleted = _rows(
        beeline(served.url, "SELECT order_id, _src_partition, _src_offset FROM served_a.orders__deletes", "csv2")
    )
    deletes = {
        (str(e.change.key["order_id"]), str(e.position.partition), str(e.position.offset))
        for e in served.replicas.log
        if e.change.op == "delete"
    }
    assert {row[0] for row in _expected(served.replicas.log, ["order_id"], live=False)} <= {row[0] for row in deleted}
    assert {tuple(row) for row in deleted} <= deletes
    _, quarantined = _rows(beeline(served.url, "SELECT offset, topic FROM served_a.quarantine", "csv2"))
    assert quarantined == [[str(served.replicas.garbage_offset), "served-orders"]]
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
    good = _run([replica, "sql", str(served.replicas.a_conf), query], served.env)
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
    run_available_now(spark, served.replicas.b)  # nothing new in the log: it starts, leaves its names, and stops
    wait_for(lambda: not pending(local_settings()), 60, "the server to take the replica's names (every second)")
    _, rows = _rows(beeline(served.url, "SELECT * FROM served_b.orders", "csv2"))
    assert rows == _expected(served.replicas.log, COLUMNS)
