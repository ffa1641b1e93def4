"""Topic administration against the real embedded broker."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from jobs import topics as topics_job
from replica_dev.embedded_kafka import free_port
from replica_lib.errors import TopicError
from replica_lib.topics import DAY_MS, TopicAdmin, TopicReport, TopicSpec

pytestmark = pytest.mark.integration


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_ensure_creates_a_compacted_topic_as_specified(connection: dict[str, str]) -> None:
    admin = TopicAdmin(connection)
    name = unique("orders")
    spec = TopicSpec.local(name, partitions=4, delete_retention_ms=2 * DAY_MS)

    report = admin.ensure(spec, local=True)

    assert report.created
    assert (report.name, report.partitions, report.replication_factor) == (name, 4, 1)
    assert [(f.level, f.setting) for f in report.findings] == [("note", "replication.factor")]
    assert not report.unsafe
    described = admin.describe(name)
    assert described is not None
    partitions, replication, configs = described
    assert (partitions, replication) == (4, 1)
    assert configs["cleanup.policy"] == "compact"
    assert configs["min.insync.replicas"] == "1"
    assert configs["delete.retention.ms"] == str(2 * DAY_MS)
    assert configs["unclean.leader.election.enable"] == "false"


def test_ensure_on_an_existing_topic_does_not_create_it_again(connection: dict[str, str]) -> None:
    admin = TopicAdmin(connection)
    spec = TopicSpec.local(unique("orders"), partitions=2)
    assert admin.ensure(spec, local=True).created

    again = admin.ensure(spec, local=True)

    assert not again.created
    assert again.partitions == 2
    assert not again.unsafe


def test_ensure_reports_a_partition_mismatch_with_an_existing_topic(connection: dict[str, str]) -> None:
    admin = TopicAdmin(connection)
    name = unique("orders")
    admin.ensure(TopicSpec.local(name, partitions=2), local=True)

    report = admin.ensure(TopicSpec.local(name, partitions=5), local=True)

    assert not report.created
    assert [(f.level, f.setting) for f in report.findings if f.level != "note"] == [("mismatch", "partitions")]
    assert report.unsafe


def test_ensure_creates_many_topics_back_to_back(connection: dict[str, str]) -> None:
    """Metadata lags topic creation; ensure() must wait for it rather than report the new topic missing."""
    admin = TopicAdmin(connection)

    reports = [admin.ensure(TopicSpec.local(unique("burst"), partitions=3), local=True) for _ in range(8)]

    assert [(r.created, r.partitions) for r in reports] == [(True, 3)] * 8


def test_a_created_topic_has_a_leader_for_every_partition_when_ensure_returns(connection: dict[str, str]) -> None:
    """A partition without its leader refuses writes, and librdkafka then acknowledges refused writes without
    offsets when a later one to that partition is taken: they are lost. After ensure() none is refused."""
    admin = TopicAdmin(connection)
    name = unique("ready")

    admin.ensure(TopicSpec.local(name, partitions=40), local=True)

    client = AdminClient({**connection, "logger": logging.getLogger(__name__)})  # quiet once the broker stops
    request = {TopicPartition(name, p): OffsetSpec.latest() for p in range(40)}
    futures = client.list_offsets(request, request_timeout=10)
    errors = {}
    for tp, future in futures.items():
        try:
            future.result(timeout=10)
        except KafkaException as exc:
            errors[tp.partition] = exc.args[0].str()
    assert errors == {}


def test_validate_flags_a_delete_policy_topic_with_finite_retention(connection: dict[str, str]) -> None:
    admin = TopicAdmin(connection)
    name = unique("events")
    spec = TopicSpec.local(name, compact=False, extra=(("retention.ms", "3600000"),))
    admin.ensure(spec, local=True)

    report = admin.validate(name, local=True)

    assert report.configs["cleanup.policy"] == "delete"
    assert report.configs["retention.ms"] == "3600000"
    unsafe = [f for f in report.findings if f.level == "unsafe"]
    assert [f.setting for f in unsafe] == ["cleanup.policy"]
    assert "rebuilt" in unsafe[0].message
    assert report.unsafe


def test_validate_flags_a_topic_created_with_broker_defaults(connection: dict[str, str]) -> None:
    name = unique("plain")
    client = AdminClient(connection)
    client.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(timeout=15)
    admin = TopicAdmin(connection)

    report = _validate_eventually(admin, name)

    assert report.configs["cleanup.policy"] == "delete"
    assert [f.setting for f in report.findings if f.level == "unsafe"] == ["cleanup.policy"]


def _validate_eventually(admin: TopicAdmin, name: str, timeout_s: float = 15.0) -> TopicReport:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return admin.validate(name, local=True)
        except TopicError:
            if time.monotonic() > deadline:
                raise


def test_validate_of_a_missing_topic_raises(connection: dict[str, str]) -> None:
    name = unique("missing")

    with pytest.raises(TopicError, match=f"topic '{name}' does not exist"):
        TopicAdmin(connection).validate(name)


def test_describe_of_a_missing_topic_is_none_and_does_not_create_it(connection: dict[str, str]) -> None:
    admin = TopicAdmin(connection)
    name = unique("missing")

    assert admin.describe(name) is None
    assert name not in AdminClient(connection).list_topics(timeout=10).topics


def test_delete_removes_a_topic(connection: dict[str, str]) -> None:
    admin = TopicAdmin(connection)
    name = unique("doomed")
    admin.ensure(TopicSpec.local(name, partitions=1), local=True)

    admin.delete(name)

    deadline = time.monotonic() + 15
    while admin.describe(name) is not None:
        assert time.monotonic() < deadline, "deleted topic still listed"
    with pytest.raises(TopicError, match=name):
        admin.delete(name)


def test_unreachable_broker_raises_topic_error_quickly() -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()

    with pytest.raises(TopicError, match=f"cannot reach Kafka at {address}"):
        TopicAdmin({"bootstrap.servers": address}, timeout_s=2)

    assert time.monotonic() - started < 15


# ---------------------------------------------------------------------------------------------- the job
def test_topics_job_creates_then_validates(connection: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    name = unique("jobs")
    servers = ["--bootstrap-servers", connection["bootstrap.servers"]]

    assert topics_job.main(["create", name, "--partitions", "2", "--local", *servers]) == 0
    assert f"topic {name}: created, 2 partitions, replication factor 1, cleanup.policy=compact" in (
        capsys.readouterr().out
    )
    assert topics_job.main(["validate", name, "--local", *servers]) == 0
    assert f"topic {name}: exists" in capsys.readouterr().out
    assert topics_job.main(["validate", name, *servers]) == 1  # rf 1 is unsafe off the sandbox
    assert "[unsafe] replication.factor" in capsys.readouterr().out


def test_topics_job_rejects_impossible_settings_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "create",
        "orders",
        "--replication-factor",
        "1",
        "--min-insync-replicas",
        "2",
        "--bootstrap-servers",
        "127.0.0.1:1",
    ]

    with pytest.raises(SystemExit) as info:
        topics_job.main(argv)

    assert info.value.code == 2
    assert "min_insync_replicas cannot exceed replication_factor" in capsys.readouterr().err
