"""Shared fixtures: one SparkSession (local[2], Delta, Kafka source) and one real Kafka broker per test run."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from replica_dev.embedded_kafka import EmbeddedKafka
from replica_lib.config import LocalSettings, local_settings
from replica_lib.session import build_session
from replica_lib.topics import TopicAdmin, TopicSpec

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


@pytest.fixture(scope="session", autouse=True)
def catalog_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's own local catalog: replicas started by tests leave their names there, not in the checkout's."""
    path = tmp_path_factory.mktemp("catalog")
    os.environ["REPLICA_CATALOG_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def settings(catalog_dir: Path) -> LocalSettings:
    return local_settings()


@pytest.fixture(scope="session")
def spark(settings: LocalSettings) -> Iterator[SparkSession]:
    session = build_session(
        "replica-tests",
        settings,
        master="local[2]",
        extra={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def kafka(settings: LocalSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedKafka]:
    # The log cleaner looks for work every 0.5 s (15 s by default), so a test can wait for it to compact a topic.
    broker = EmbeddedKafka(
        tmp_path_factory.mktemp("broker"),
        settings.state_dir,
        settings.java_home,
        properties={"log.cleaner.backoff.ms": "500"},
    )
    with broker:
        yield broker


@pytest.fixture
def connection(kafka: EmbeddedKafka) -> dict[str, str]:
    return {"bootstrap.servers": kafka.bootstrap_servers}


@pytest.fixture
def topic_factory(connection: dict[str, str]) -> object:
    """Creates uniquely named local topics: ``topic_factory(partitions=3) -> name``."""
    admin = TopicAdmin(connection)

    def create(partitions: int = 3, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin.ensure(TopicSpec.local(name, partitions=partitions), local=True)
        return name

    return create
