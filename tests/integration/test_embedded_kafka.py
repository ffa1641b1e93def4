"""The embedded broker's life cycle: a second broker, restarts, refusals, no JVM outliving its owner."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from jobs.dev import broker as broker_job
from replica_dev import maven
from replica_dev.embedded_kafka import EmbeddedKafka, find_brokers
from replica_lib.config import PROJECT_ROOT, LocalSettings
from replica_lib.errors import BrokerError, ProducerError, SetupError
from replica_lib.producer import Change, ChangeProducer, Position, encode_key, encode_value
from replica_lib.topics import TopicAdmin, TopicSpec

pytestmark = pytest.mark.integration


def brokers_on(data_dir: Path) -> list[int]:
    """Pids of broker JVMs running on ``data_dir``."""
    return [b.pid for b in find_brokers() if b.data_dir == data_dir.resolve()]


def read_at(bootstrap_servers: str, position: Position, timeout_s: float = 30.0) -> tuple[bytes | None, bytes | None]:
    """The key and value of the record at ``position``."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"test-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        consumer.assign([TopicPartition(position.topic, position.partition, position.offset)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None and msg.offset() == position.offset:
                return msg.key(), msg.value()
        raise AssertionError(f"no record at {position} within {timeout_s}s")
    finally:
        consumer.close()


def topic_names(bootstrap_servers: str) -> set[str]:
    """Every topic on the cluster (a full listing never auto-creates anything)."""
    return set(AdminClient({"bootstrap.servers": bootstrap_servers}).list_topics(timeout=10).topics)


@pytest.fixture(scope="module")
def default_broker(settings: LocalSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedKafka]:
    """A second broker, with Kafka's own default of creating topics on first use (as most clusters have)."""
    broker = EmbeddedKafka(
        tmp_path_factory.mktemp("second-broker"),
        settings.state_dir,
        settings.java_home,
        properties={"auto.create.topics.enable": "true"},
    )
    with broker:
        yield broker


# ------------------------------------------------------------------------------------------ a second broker
def test_second_broker_runs_beside_the_session_broker(default_broker: EmbeddedKafka, kafka: EmbeddedKafka) -> None:
    assert default_broker.healthy()
    assert kafka.healthy()
    assert default_broker.port != kafka.port
    assert brokers_on(default_broker.data_dir) == [default_broker.pid]
    found = next(b for b in find_brokers() if b.pid == default_broker.pid)
    assert found.owner_pid == os.getpid()
    assert not found.orphaned
    state = EmbeddedKafka.read_state(default_broker.data_dir)
    assert state is not None
    assert state["bootstrap_servers"] == default_broker.bootstrap_servers


def test_restart_keeps_the_port_and_the_data(default_broker: EmbeddedKafka) -> None:
    connection = {"bootstrap.servers": default_broker.bootstrap_servers}
    topic = f"durable-{uuid.uuid4().hex[:10]}"
    TopicAdmin(connection).ensure(TopicSpec.local(topic, partitions=2), local=True)
    change = Change(key={"order_id": 7}, data={"order_id": 7, "status": "shipped"}, seq=3)
    with ChangeProducer(connection) as producer:
        position = producer.write(topic, change)
    port, pid = default_broker.port, default_broker.pid

    default_broker.restart()

    assert default_broker.port == port
    assert default_broker.pid != pid
    assert default_broker.healthy()
    assert brokers_on(default_broker.data_dir) == [default_broker.pid]
    assert read_at(default_broker.bootstrap_servers, position) == (
        encode_key(change.key),
        encode_value(change),
    )


def test_lookups_never_auto_create_topics(default_broker: EmbeddedKafka) -> None:
    connection = {"bootstrap.servers": default_broker.bootstrap_servers}
    missing = f"missing-{uuid.uuid4().hex[:10]}"

    assert TopicAdmin(connection).describe(missing) is None
    with ChangeProducer(connection) as producer, pytest.raises(ProducerError, match=missing):
        producer.upsert(missing, {"id": 1}, {"id": 1})

    # Auto-creation is asynchronous. A plain client's lookup after ours does create its topic (the hazard is
    # real on this broker); once that one shows, a creation triggered by our earlier lookups would show too.
    probe = f"probe-{uuid.uuid4().hex[:10]}"
    Producer(connection).list_topics(topic=probe, timeout=10)
    deadline = time.monotonic() + 15
    while probe not in (names := topic_names(default_broker.bootstrap_servers)):
        assert time.monotonic() < deadline, "the broker did not auto-create the probe topic"
    assert missing not in names


# ---------------------------------------------------------------------------------------------- refusals
def test_port_in_use_is_refused_quickly_without_a_jvm(settings: LocalSettings, tmp_path: Path) -> None:
    data_dir = tmp_path / "busy"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        broker = EmbeddedKafka(data_dir, settings.state_dir, settings.java_home, port=port)
        started = time.monotonic()

        with pytest.raises(BrokerError, match=f"port {port} on 127.0.0.1 is already in use"):
            broker.start()

        assert time.monotonic() - started < 10
    assert broker.pid is None
    assert brokers_on(data_dir) == []


def test_a_data_dir_with_a_running_broker_is_refused(settings: LocalSettings, kafka: EmbeddedKafka) -> None:
    intruder = EmbeddedKafka(kafka.data_dir, settings.state_dir, settings.java_home)

    with pytest.raises(BrokerError, match=f"a broker already runs on {kafka.data_dir} \\(pid {kafka.pid}\\)"):
        intruder.start()

    assert intruder.pid is None
    assert brokers_on(kafka.data_dir) == [kafka.pid]
    assert kafka.healthy()


# ---------------------------------------------------------------------------------------------- orphans
CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from replica_dev.embedded_kafka import EmbeddedKafka

    broker = EmbeddedKafka(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] or None).start()
    print(broker.pid, flush=True)
    sys.stdin.read()  # hold the broker until killed
    """
)


def test_broker_dies_with_its_owner(settings: LocalSettings, tmp_path: Path) -> None:
    data_dir = tmp_path / "orphan"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    args = [sys.executable, "-c", CHILD, str(data_dir), str(settings.state_dir), settings.java_home or ""]
    owner = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=PROJECT_ROOT, env=env)
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()  # the child prints the pid once the broker answers (or exits on failure)
        assert line.strip().isdigit(), f"the child did not start a broker (exit code {owner.poll()})"
        broker_pid = int(line)
        found = [b for b in find_brokers() if b.pid == broker_pid]
        assert [(b.data_dir, b.owner_pid) for b in found] == [(data_dir.resolve(), owner.pid)]

        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)

        deadline = time.monotonic() + 30
        while brokers_on(data_dir):
            assert time.monotonic() < deadline, f"broker pid {broker_pid} outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
        for pid in brokers_on(data_dir):  # only if the test failed: never leave the JVM behind
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- the job
def test_broker_job_reports_no_broker_for_an_empty_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kafka: EmbeddedKafka
) -> None:
    monkeypatch.setenv("REPLICA_STATE_DIR", str(tmp_path))

    assert broker_job.main(["status"]) == 1
    out = capsys.readouterr().out
    assert "no broker running here" in out  # the session broker runs elsewhere on this machine
    assert broker_job.main(["stop"]) == 0
    assert "no broker running" in capsys.readouterr().out
    assert kafka.healthy()


def test_a_failed_artifact_download_says_what_and_how_to_fix(settings: LocalSettings, tmp_path: Path) -> None:
    java = maven.find_java(settings.java_home)
    with pytest.raises(SetupError) as caught:
        maven.resolve_jars(java, ("org.apache.kafka:no-such-artifact-replica:0.0.1",), tmp_path, "missing")
    message = str(caught.value)
    assert "could not download missing jars from Maven Central" in message
    assert "no-such-artifact-replica" in message
    assert list(tmp_path.glob("jars/*/.resolved")) == []  # a later run retries instead of trusting a partial cache
