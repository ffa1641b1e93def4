"""Helpers for the materializer's integration tests: replica configs under tmp_path, runs, expected frames."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from replica_dev.conf import orders_table as orders_table  # re-exported for the tests
from replica_dev.conf import replica_doc
from replica_dev.embedded_kafka import die_with
from replica_dev.model import LoggedChange, fold
from replica_lib.config import PROJECT_ROOT, ReplicaConfig, parse_replica
from replica_lib.layout import read_state
from replica_lib.producer import Change, ChangeProducer, ProducerSettings
from replica_lib.stream import start_replica
from replica_lib.target import table_schema
from tests.conftest import default_jvm_environ

RUN_TIMEOUT_S = 300


def replica_config(
    tmp_path: Path,
    bootstrap: str,
    name: str,
    tables: Mapping[str, Mapping[str, Any]],
    **source: Any,
) -> ReplicaConfig:
    """A replica whose checkpoint and tables live under ``tmp_path/name``, applying what is in the log and stopping."""
    doc = replica_doc(
        name,
        tmp_path / name,
        bootstrap,
        tables,
        source={"starting_offsets": "earliest", **source},
        trigger={"available_now": True},
    )
    return parse_replica(doc, f"{name}.toml", {})


def run_available_now(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Apply everything in the log now; raises the query's exception if a batch fails."""
    query = start_replica(spark, cfg, available_now=True)
    try:
        finished = query.awaitTermination(RUN_TIMEOUT_S)
        assert finished, f"replica {cfg.name} did not drain the log within {RUN_TIMEOUT_S}s"
    finally:
        query.stop()


def replica_df(spark: SparkSession, cfg: ReplicaConfig, table: str) -> DataFrame:
    """The replica table's state (a merge-on-read table's view) without the event-time column (checked apart)."""
    return read_state(spark, cfg.table(table)).drop("_src_event_ts")


def expected_df(spark: SparkSession, cfg: ReplicaConfig, table: str, events: Iterable[LoggedChange]) -> DataFrame:
    """The reference model's rows for ``table``, in the replica table's schema (minus event time)."""
    spec = cfg.table(table)
    schema = table_schema(spec, cfg.source_file)
    rows = fold(list(events), {table: spec.keys}, {table: spec.sequence_by is not None})[table]
    fields = [f for f in schema.replica_schema.fields if f.name != "_src_event_ts"]
    data = [tuple(row.get(f.name) for f in fields) for row in rows.values()]
    return spark.createDataFrame(data, schema=T.StructType(fields))


def produce(
    connection: Mapping[str, str],
    topic: str,
    changes: Iterable[Change],
    table: str = "orders",
    transactional_id: str | None = None,
) -> list[LoggedChange]:
    """Write ``changes`` in order; returns each with its acknowledged position."""
    # The tests play primaries that break the rules too (late changes): the producer writes what it is given.
    settings = ProducerSettings(transactional_id=transactional_id, on_lower_seq="allow")
    batch = list(changes)
    with ChangeProducer(connection, settings) as producer:
        if transactional_id:
            with producer.transaction():
                deliveries = [producer.send(topic, change) for change in batch]
        else:
            deliveries = [producer.send(topic, change) for change in batch]
        producer.flush()
        return [LoggedChange(d.result(), c, table) for d, c in zip(deliveries, batch, strict=True)]


def upsert(order_id: int, seq: int | None, status: str, amount: float = 10.0, table: str | None = None) -> Change:
    row = {"order_id": order_id, "customer": f"c{order_id}", "amount": amount, "status": status, "updated_ms": seq}
    return Change(key={"order_id": order_id}, op="upsert", data=row, seq=seq, ts_ms=1_700_000_000_000, table=table)


def delete(order_id: int, seq: int | None, table: str | None = None) -> Change:
    return Change(key={"order_id": order_id}, op="delete", seq=seq, table=table)


def tombstone(order_id: int) -> Change:
    return Change(key={"order_id": order_id}, op="delete", tombstone=True)


def end_offsets(log: Iterable[LoggedChange]) -> dict[int, int]:
    """Per partition, the offset after the last record of ``log`` (Spark's exclusive end offset)."""
    ends: dict[int, int] = {}
    for event in log:
        ends[event.position.partition] = max(ends.get(event.position.partition, 0), event.position.offset + 1)
    return ends


def produce_garbage(connection: dict[str, str], topic: str, partition: int) -> int:
    """One record that is not a change event, to ``partition``; returns its offset."""
    offsets: list[int | None] = []
    producer = Producer({**connection, "enable.idempotence": True})
    producer.produce(
        topic,
        key=b'{"order_id": 999}',
        value=b"not json",
        partition=partition,
        on_delivery=lambda _e, m: offsets.append(m.offset()),
    )
    producer.flush(30)
    (offset,) = offsets
    assert offset is not None
    return offset


#: Seconds the test waits for the run once it is its turn: the run may still be on its first phase if the suite
#: left it no CPU until then.
WAIT_S = 900


@dataclass
class BenchRun:
    """The benchmark job started in the background: its process, its output files and its own catalog."""

    proc: subprocess.Popen[str]
    stdout: Path
    stderr: Path
    out: Path
    catalog: Path

    def wait(self) -> tuple[int, str, str]:
        """The job's exit code, stdout and stderr, once it has ended (killed after :data:`WAIT_S`)."""
        try:
            code = self.proc.wait(timeout=WAIT_S)
        finally:
            self.kill()
        return code, self.stdout.read_text(), self.stderr.read_text()

    def kill(self) -> None:
        """Kill the job and every process it started (spark-submit's JVM, the Python driver) that still runs."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start_bench(bootstrap_servers: str, workdir: Path) -> BenchRun:
    """Start the benchmark's smoke run, niced, with a catalog of its own (so that its check sees only its names)."""
    out, catalog = workdir / "out", workdir / "catalog"
    args = {
        "--events": 400,
        "--keys": 150,
        "--batch-size": 150,
        "--fresh-contenders": "ceiling,ours,ours-mor",
        "--fresh-rate": 50,
        "--fresh-seconds": 2,
        "--fresh-rows": 500,
        "--growth-rows": 1000,
        "--growth-keys": "uniform",  # recent keys take the same path
        "--growth-batch-size": 50,
        "--growth-batches": 2,
        "--warmup-events": 0,
        "--repeats": 1,
        "--bootstrap-servers": bootstrap_servers,
        "--workdir": workdir / "work",
        "--out": out,
    }
    stdout, stderr = workdir / "stdout.log", workdir / "stderr.log"
    env = {**default_jvm_environ(), "REPLICA_CATALOG_DIR": str(catalog)}  # the JVM's default compilers: it runs long
    with stdout.open("w") as out_file, stderr.open("w") as err_file:
        proc = subprocess.Popen(
            [
                "nice",
                "-n",
                "19",
                str(PROJECT_ROOT / "spark-submit.sh"),
                "jobs/dev/bench.py",
                *(str(x) for kv in args.items() for x in kv),
                "--profile",
            ],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=out_file,
            stderr=err_file,
            text=True,
            start_new_session=True,  # a process group of its own, to kill whole
            preexec_fn=die_with(os.getpid()),  # and killed with this process if it dies without its teardown
        )
    return BenchRun(proc, stdout, stderr, out, catalog)


class BenchStarter:
    """Starts the benchmark's smoke run once, when the first test that may run beside it begins."""

    def __init__(self, bootstrap_servers: str, workdir: Path) -> None:
        self._servers, self._workdir = bootstrap_servers, workdir
        self._run: BenchRun | None = None

    def start(self) -> BenchRun:
        if self._run is None:
            self._run = start_bench(self._servers, self._workdir)
        return self._run

    def kill(self) -> None:
        if self._run is not None:
            self._run.kill()
