"""Kafka -> raw rows: Spark's own kafka source, reading only committed records."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from replica_lib.config import ReplicaConfig
from replica_lib.errors import ConfigError

logger = logging.getLogger(__name__)


def source_options(cfg: ReplicaConfig, starting_offsets: str | None = None) -> dict[str, str]:
    """Options for ``spark.readStream.format("kafka")``; any ``kafka.*`` option of the config passes through."""
    options = cfg.kafka.spark_options()
    options.update(
        {
            "subscribe": ",".join(cfg.topics),
            "startingOffsets": starting_offsets or cfg.source.starting_offsets,
            "failOnDataLoss": "true" if cfg.source.fail_on_data_loss else "false",
            # An aborted transaction is never applied; records above the last stable offset wait.
            "kafka.isolation.level": "read_committed",
            "groupIdPrefix": f"replica-{cfg.name}",
            "includeHeaders": "false",
        }
    )
    if cfg.source.max_offsets_per_trigger:
        options["maxOffsetsPerTrigger"] = str(cfg.source.max_offsets_per_trigger)
    return options


def check_reachable(cfg: ReplicaConfig, timeout_s: float = 15.0) -> None:
    """Fail fast, with the fix, if no bootstrap server accepts a TCP connection, or the cluster refuses the login.

    Spark's Kafka source would otherwise retry for minutes before the query fails, or fail with a stack trace.
    The login is checked with confluent-kafka when the replica's options translate to it (see
    :meth:`KafkaConfig.client_config`); otherwise that check is skipped with a warning and Spark's client decides.
    """
    servers = [s.strip() for s in cfg.kafka.bootstrap_servers.split(",") if s.strip()]
    deadline = time.monotonic() + timeout_s
    last_error = "no servers"
    while True:
        for server in servers:
            host, _, port = server.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(
                    cfg.source_file,
                    "kafka.bootstrap_servers",
                    f"{server!r} is not host:port",
                    'e.g. bootstrap_servers = "broker1:9092,broker2:9092"',
                )
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                    _check_login(cfg, max(deadline - time.monotonic(), 5.0))
                    return
            except OSError as exc:
                last_error = f"{server}: {exc.strerror or exc}"
        if time.monotonic() >= deadline:
            raise ConfigError(
                cfg.source_file,
                "kafka.bootstrap_servers",
                f"no Kafka broker reachable within {timeout_s:.0f}s ({last_error})",
                "check the address and that the brokers are up",
            )
        time.sleep(0.5)  # retry until the deadline: a broker that is starting up gets a moment


def _check_login(cfg: ReplicaConfig, timeout_s: float) -> None:
    """Raise :class:`ConfigError` if the cluster refuses the replica's credentials or lacks one of its topics."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    client = cfg.kafka.client_config()
    if client.settings is None:
        logger.warning("replica %s: not checking the Kafka login before the start: %s", cfg.name, client.reason)
        return
    errors: list[KafkaError] = []
    conf: dict[str, Any] = {
        **client.settings,
        "error_cb": errors.append,  # a refused login is reported once, below, not as librdkafka's log lines
        "log_level": 0,
    }
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            metadata = admin.list_topics(timeout=1)
        except KafkaException:
            admin.poll(0)  # serves the error callback
        else:
            _check_topics_exist(cfg, set(metadata.topics))
            return
        refused = next((e for e in errors if e.code() == KafkaError._AUTHENTICATION), None)
        if refused is not None:
            given = dict(cfg.kafka.options)
            key = next((k for k in ("sasl.jaas.config", "sasl.password") if k in given), "security.protocol")
            raise ConfigError(
                cfg.source_file,
                f"kafka.options.{key}",
                f"Kafka at {cfg.kafka.bootstrap_servers} refused the login ({refused.str()})",
                "check the user name, password and sasl.mechanism the cluster expects",
            )
    logger.warning("replica %s: Kafka did not answer a metadata request within %.0fs", cfg.name, timeout_s)


def _check_topics_exist(cfg: ReplicaConfig, topics: set[str]) -> None:
    """Refuse a replica whose topic does not exist: Spark's source would wait on it, then fail with a trace."""
    for table in cfg.tables:
        if table.topic not in topics:
            raise ConfigError(
                cfg.source_file,
                f"tables.{table.name}.topic",
                f"topic {table.topic!r} does not exist on {cfg.kafka.bootstrap_servers}",
                "create the topic before the replica starts, or correct its name",
            )


def read_changes(spark: SparkSession, cfg: ReplicaConfig, starting_offsets: str | None = None) -> DataFrame:
    """The replica's topics as a stream of raw records (key, value, topic, partition, offset, timestamp)."""
    if not cfg.source.fail_on_data_loss:
        logger.warning(
            "replica %s: failOnDataLoss is OFF (%s, source.fail_on_data_loss = false): if the log loses "
            "records this replica has not read, it will SKIP them silently and diverge from the primary",
            cfg.name,
            cfg.source_file,
        )
    reader = spark.readStream.format("kafka")
    for key, value in source_options(cfg, starting_offsets).items():
        reader = reader.option(key, value)
    return reader.load().select("key", "value", "topic", "partition", "offset", "timestamp")
