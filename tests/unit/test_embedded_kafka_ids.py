"""The embedded broker's cluster ids: never one that Kafka's storage tool would read as an option."""

from __future__ import annotations

import uuid

import pytest

from replica_dev import embedded_kafka


def test_a_cluster_id_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0xF8 encodes to '-' in base64url: the first draw would make `kafka-storage format -t -…` fail.
    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x01" + bytes(15))])
    monkeypatch.setattr(embedded_kafka.uuid, "uuid4", lambda: next(draws))
    cluster_id = embedded_kafka.new_cluster_id()
    assert cluster_id == "AQAAAAAAAAAAAAAAAAAAAA"
    assert len(cluster_id) == 22


def test_cluster_ids_are_random() -> None:
    ids = {embedded_kafka.new_cluster_id() for _ in range(2_000)}
    assert len(ids) == 2_000 and not any(i.startswith("-") for i in ids)
