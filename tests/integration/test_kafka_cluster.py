"""Durability on a real three-node KRaft cluster: a partition leader SIGKILLed under a running replica."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from replica_dev import loadgen
from replica_dev.conf import replica_doc
from replica_dev.embedded_kafka import KafkaCluster
from replica_dev.model import LoggedChange
from replica_lib.config import LocalSettings, parse_replica
from replica_lib.errors import ProducerError
from replica_lib.producer import ChangeProducer, ProducerSettings
from replica_lib.stream import start_replica
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import orders_table, upsert
from tests.integration.test_semantics import assert_matches_model

pytestmark = pytest.mark.integration

FAILOVER_OPTIONS = {"default.api.timeout.ms": "10000", "request.timeout.ms": "8000"}


@pytest.fixture(scope="module")
def cluster(settings: LocalSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    with KafkaCluster(tmp_path_factory.mktemp("cluster"), settings.state_dir, java_home=settings.java_home) as nodes:
        yield nodes


def test_a_leader_killed_under_acks_all_loses_and_doubles_no_acknowledged_write(
    spark: SparkSession, cluster: KafkaCluster, tmp_path: Path
) -> None:
    connection = {"bootstrap.servers": cluster.bootstrap_servers}
    topic = f"durable-{uuid.uuid4().hex[:8]}"
    TopicAdmin(connection).ensure(TopicSpec(topic, partitions=1, replication_factor=3, min_insync_replicas=2))
    doc = replica_doc(
        "durable",
        tmp_path / "durable",
        cluster.bootstrap_servers,
        {"orders": orders_table(topic)},
        # The source's offset requests give up on a dead leader after 10 s and retry on the new one (Kafka's
        # default: 60 s, which the replica then waits on each leader change); see the README.
        kafka={"bootstrap_servers": cluster.bootstrap_servers, "options": FAILOVER_OPTIONS},
        source={"starting_offsets": "earliest"},
        trigger={"interval": "0 seconds"},
    )
    cfg = parse_replica(doc, "durable.toml", {})
    changes = loadgen.generate(loadgen.Workload(keys=40, events=600, seed=31))

    query = start_replica(spark, cfg)
    acknowledged: list[LoggedChange] = []
    try:
        with ChangeProducer(connection) as producer:  # acks=all, idempotent: the library's fixed settings
            for change in changes[:300]:
                acknowledged.append(LoggedChange(producer.write(topic, change), change, "orders"))
            query.processAllAvailable()
            leader = cluster.leader(topic, 0)
            # The leader dies with writes in flight: the producer retries them on the new leader, in order, once.
            pending = [(producer.send(topic, change), change) for change in changes[300:]]
            cluster.node(leader).kill()
            acknowledged += [LoggedChange(d.result(60), c, "orders") for d, c in pending]
            assert cluster.leader(topic, 0) != leader
        query.processAllAvailable()
        assert query.isActive and query.exception() is None  # the replica rode through the leader change
    finally:
        query.stop()
    assert_matches_model(spark, cfg, acknowledged)
    offsets = [e.position.offset for e in acknowledged]
    assert offsets == sorted(set(offsets))  # every write once, in the order it was sent

    # With a second node down only one replica of the partition is in sync, below min.insync.replicas: a write is
    # refused, loudly, rather than acknowledged.
    survivors = [n for n in range(1, 4) if n != leader]
    cluster.node(survivors[0]).kill()
    settings = ProducerSettings(delivery_timeout_ms=15_000)
    with pytest.raises(ProducerError), ChangeProducer(connection, settings) as producer:
        producer.write(topic, upsert(10_000, 1, "unacknowledged"))
