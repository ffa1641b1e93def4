"""replica_lib.producer: a broker that is down is reported, not logged several times a second."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from replica_lib.producer import _ErrorLog, _LibrdkafkaLog


def test_each_kind_of_error_is_logged_once_per_interval_with_its_repeats(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = _ErrorLog(interval_s=30.0, clock=lambda: now[0])
    refused, timed_out = KafkaError._TRANSPORT, KafkaError._TIMED_OUT
    with caplog.at_level(logging.WARNING, logger="replica_lib.producer"):
        for second in range(0, 61):  # two failures a second for a minute, and one timeout
            now[0] = float(second)
            log(refused, "Connect to 127.0.0.1:9092 failed: Connection refused")
            log(refused, "Connect to 127.0.0.1:9092 failed: Connection refused")
            if second == 10:
                log(timed_out, "1 request(s) timed out")
    assert [r.getMessage() for r in caplog.records] == [
        "Kafka producer: Connect to 127.0.0.1:9092 failed: Connection refused",
        "Kafka producer: 1 request(s) timed out",
        "Kafka producer: Connect to 127.0.0.1:9092 failed: Connection refused (and 59 more like it in the last 30s)",
        "Kafka producer: Connect to 127.0.0.1:9092 failed: Connection refused (and 59 more like it in the last 30s)",
    ]


def test_librdkafka_leaves_failed_connections_to_the_error_callback(caplog: pytest.LogCaptureFixture) -> None:
    log = _LibrdkafkaLog()
    with caplog.at_level(logging.DEBUG, logger="replica_lib.producer.librdkafka"):
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "Connect to ipv4#127.0.0.1:9092 failed")
        log.log(logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "Configuration property ignored")
    assert [r.getMessage() for r in caplog.records] == ["CONFWARN [rdkafka#producer-1] Configuration property ignored"]
