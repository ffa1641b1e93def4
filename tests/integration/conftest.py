"""Two small replicas of one log, built once per run for the tests that read them by name (catalog, server,
notebooks): ``served_a`` copy-on-write with a metrics table, ``served_b`` merge-on-read with nothing folded."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from replica_dev.conf import orders_table, replica_doc, write_replica
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_dev.model import LoggedChange
from replica_lib.config import ReplicaConfig, load_replica
from replica_lib.stream import run_replica
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import (
    BenchStarter,
    delete,
    produce,
    produce_garbage,
    run_available_now,
    tombstone,
    upsert,
)


@dataclass(frozen=True)
class TwoReplicas:
    root: Path
    topic: str
    log: list[LoggedChange]
    garbage_offset: int  # one record that is not a change, in partition 0
    a: ReplicaConfig
    b: ReplicaConfig
    a_conf: Path
    b_conf: Path


def changes() -> list[Any]:
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
        *(upsert(order_id, 1, "new", amount=order_id * 1.5) for order_id in range(7, 13)),
        *(upsert(order_id, 2, "paid", amount=order_id * 1.5) for order_id in range(7, 13)),
    ]


BENCH_TESTS = "tests/integration/test_bench.py::"
#: The tests the benchmark's run does not start beside: the Thrift server's start (a JVM resolving and loading
#: Spark's packages) took 132 s beside the run's start, 81 s alone.
BENCH_AFTER = "tests/integration/test_catalog_server.py::"


@pytest.fixture(scope="session")
def bench_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BenchStarter | None]:
    """The benchmark's smoke run when test_bench.py runs (last: it waits for the run there), started beside the
    other tests (:func:`bench_beside`) so that it uses the CPU they leave idle."""
    if not any(item.nodeid.startswith(BENCH_TESTS) for item in request.session.items):
        yield None
        return
    kafka: EmbeddedKafka = request.getfixturevalue("kafka")
    starter = BenchStarter(kafka.bootstrap_servers, tmp_path_factory.mktemp("bench"))
    try:
        yield starter
    finally:
        starter.kill()


@pytest.fixture(autouse=True)
def bench_beside(request: pytest.FixtureRequest, bench_run: BenchStarter | None) -> None:
    """Start the benchmark's run with the first integration test past :data:`BENCH_AFTER`'s."""
    if bench_run is not None and not request.node.nodeid.startswith(BENCH_AFTER):
        bench_run.start()


@pytest.fixture(scope="session")
def two_replicas(spark: SparkSession, kafka: EmbeddedKafka, tmp_path_factory: pytest.TempPathFactory) -> TwoReplicas:
    root = tmp_path_factory.mktemp("two_replicas")
    connection = {"bootstrap.servers": kafka.bootstrap_servers}
    topic = "served-orders"
    TopicAdmin(connection).ensure(TopicSpec.local(topic, partitions=2), local=True)
    log = produce(connection, topic, changes())
    garbage_offset = produce_garbage(connection, topic, 0)
    a_doc = replica_doc(
        "served_a",
        root / "a",
        kafka.bootstrap_servers,
        {"orders": orders_table(topic)},
        replica={"metrics": {"path": str(root / "a" / "_metrics")}},
        source={"starting_offsets": "earliest", "max_offsets_per_trigger": 12},  # a few batches, to plot
    )
    b_doc = replica_doc(
        "served_b",
        root / "b",
        kafka.bootstrap_servers,
        {"orders": orders_table(topic, layout="merge-on-read", fold_every_batches=0)},
    )
    a_conf, b_conf = write_replica(root / "served_a.toml", a_doc), write_replica(root / "served_b.toml", b_doc)
    a, b = load_replica(a_conf), load_replica(b_conf)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REPLICA_CATALOG_DIR", str(root / "started"))  # where their starts leave their names
        run_replica(spark, a, available_now=True)  # its metrics are written before it returns
        run_available_now(spark, b)
    return TwoReplicas(root, topic, log, garbage_offset, a, b, a_conf, b_conf)
