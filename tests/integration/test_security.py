"""A replica on a broker that requires SASL/PLAIN, with the login written for Spark's Java client.

The password is a random canary: after two runs and a maintenance run, no file the replica, Spark, Delta or
maintenance wrote, and no log line, holds it.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from jobs import maintain as maintain_job
from jobs import materialize as materialize_job
from replica_dev import loadgen
from replica_dev.conf import orders_table, write_replica
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_lib.config import LocalSettings, ReplicaConfig, parse_replica
from replica_lib.errors import ConfigError, ReplicaError
from replica_lib.producer import ChangeProducer
from replica_lib.stream import start_replica
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import run_available_now
from tests.integration.test_semantics import assert_matches_model

pytestmark = pytest.mark.integration

USER = "replica"
CANARY = f"canary-{uuid.uuid4()}"
JAAS = f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{USER}" password="${{CANARY}}";'


@pytest.fixture(scope="module")
def sasl_broker(settings: LocalSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedKafka]:
    """A broker of its own whose only client listener requires SASL/PLAIN as USER with the canary password."""
    broker = EmbeddedKafka(
        tmp_path_factory.mktemp("sasl-broker"), settings.state_dir, settings.java_home, sasl_users={USER: CANARY}
    )
    with broker:
        yield broker


def replica_doc(tmp_path: Path, broker: EmbeddedKafka, name: str, topic: str) -> dict[str, Any]:
    root = tmp_path / name
    return {
        "replica": {
            "name": name,
            "checkpoint": str(root / "_checkpoint"),
            "quarantine": {"path": str(root / "_quarantine")},
            "tombstone_retention": "1 seconds",
        },
        "kafka": {
            "bootstrap_servers": broker.bootstrap_servers,
            "options": {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.jaas.config": JAAS},
        },
        "source": {"starting_offsets": "earliest"},
        "trigger": {"available_now": True},
        "tables": {"orders": {"target": {"path": str(root / "orders")}, **orders_table(topic)}},
    }


def new_topic(broker: EmbeddedKafka) -> str:
    topic = f"secure-{uuid.uuid4().hex[:10]}"
    TopicAdmin(broker.client_config()).ensure(TopicSpec.local(topic, partitions=3), local=True)
    return topic


def files_holding(text: str, *roots: Path, skip: tuple[Path, ...] = ()) -> list[Path]:
    """Every file under ``roots`` (or a root that is a file) whose bytes contain ``text``."""
    needle = text.encode()
    files = [path for root in roots for path in ([root] if root.is_file() else sorted(root.rglob("*")))]
    return [path for path in files if path.is_file() and path not in skip and needle in path.read_bytes()]


def test_a_java_jaas_login_runs_restarts_and_maintains_without_leaking_the_password(
    spark: SparkSession,
    sasl_broker: EmbeddedKafka,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO)  # what the jobs log (py4j's debug log echoes every call into the JVM)
    caplog.set_level(logging.DEBUG, logger="replica_lib")
    topic = new_topic(sasl_broker)
    doc = replica_doc(tmp_path, sasl_broker, "secure", topic)
    cfg = parse_replica(doc, "secure.toml", {"CANARY": CANARY})
    with ChangeProducer(sasl_broker.client_config()) as producer:
        log = loadgen.run(producer, topic, loadgen.Workload(keys=60, events=900, seed=14))

    run_available_now(spark, cfg)  # start, drain, stop
    assert_matches_model(spark, cfg, log)
    with ChangeProducer(sasl_broker.client_config()) as producer:
        log += loadgen.run(producer, topic, loadgen.Workload(keys=60, events=600, seed=15))
    run_available_now(spark, cfg)  # a restart: its pre-checks read the log's start offsets with the same login
    assert_matches_model(spark, cfg, log)

    conf = write_replica(tmp_path / "secure.toml", doc)
    monkeypatch.setenv("CANARY", CANARY)
    assert maintain_job.main([str(conf)]) == 0
    assert_matches_model(spark, cfg, log)
    out, err = capfd.readouterr()
    assert "secure.orders: dropped" in out

    assert CANARY not in caplog.text
    assert CANARY not in out + err
    # Every file of the replica (checkpoint with _replica.json, tables with _delta_log, quarantine, the conf) and of
    # the broker: only the broker's own JAAS configuration holds its users' passwords.
    broker_conf = sasl_broker.data_dir / "server.properties"
    assert files_holding(CANARY, tmp_path, sasl_broker.data_dir, skip=(broker_conf,)) == []
    assert files_holding(CANARY, broker_conf) == [broker_conf]  # the search does find it where it is


def test_a_wrong_password_is_one_line_before_any_table_is_created(
    spark: SparkSession,
    sasl_broker: EmbeddedKafka,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = new_topic(sasl_broker)
    doc = replica_doc(tmp_path, sasl_broker, "refused", topic)
    wrong = f"wrong-{uuid.uuid4()}"
    cfg = parse_replica(doc, "refused.toml", {"CANARY": wrong})

    with pytest.raises(ConfigError) as refused:
        start_replica(spark, cfg, available_now=True)
    assert isinstance(refused.value, ReplicaError)
    assert refused.value.key == "kafka.options.sasl.jaas.config"
    assert "refused the login" in refused.value.problem
    assert "\n" not in str(refused.value)
    assert wrong not in str(refused.value)
    assert not (tmp_path / "refused" / "orders").exists()
    assert not (tmp_path / "refused" / "_quarantine").exists()

    conf = write_replica(tmp_path / "refused.toml", doc)
    monkeypatch.setenv("CANARY", wrong)
    capfd.readouterr()
    assert materialize_job.main([str(conf), "--available-now"]) == 2
    out, err = capfd.readouterr()
    assert err.count("\n") == 1
    assert err.startswith(f"error: {conf}: kafka.options.sasl.jaas.config: Kafka at {sasl_broker.bootstrap_servers}")
    assert "Traceback" not in out + err
    assert wrong not in out + err
    assert not (tmp_path / "refused" / "orders").exists()


def test_a_login_librdkafka_cannot_make_skips_the_pre_checks_with_a_warning(
    spark: SparkSession, sasl_broker: EmbeddedKafka, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A JKS trust store (Java only) on a restart: the replica runs, the pre-checks say why they did not."""
    topic = new_topic(sasl_broker)
    with ChangeProducer(sasl_broker.client_config()) as producer:
        log = loadgen.run(producer, topic, loadgen.Workload(keys=20, events=200, seed=16))
    doc = replica_doc(tmp_path, sasl_broker, "javaonly", topic)
    cfg = parse_replica(doc, "javaonly.toml", {"CANARY": CANARY})
    run_available_now(spark, cfg)
    # Spark's client ignores trust stores on a plaintext listener; librdkafka cannot read a JKS one at all.
    doc["kafka"]["options"]["ssl.truststore.location"] = str(tmp_path / "truststore.jks")
    java_only: ReplicaConfig = parse_replica(doc, "javaonly.toml", {"CANARY": CANARY})
    assert java_only.kafka.client_config().settings is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="replica_lib"):
        run_available_now(spark, java_only)
    assert_matches_model(spark, java_only, log)
    skipped = Counter(r.name for r in caplog.records if "ssl.truststore.location is a JKS" in r.getMessage())
    assert skipped["replica_lib.source"] == skipped["replica_lib.stream"] == 1  # the login and the log's start
    assert set(skipped.values()) == {1}, skipped  # one line for each check that skipped itself
    assert CANARY not in caplog.text
