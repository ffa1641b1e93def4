"""The producer's side of the change-event contract (docs/design.md §3) and its client settings, no broker."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from replica_lib.producer import Change, ProducerSettings, encode_key, encode_value

CONNECTION = {"bootstrap.servers": "127.0.0.1:9092", "security.protocol": "PLAINTEXT"}


# ---------------------------------------------------------------------------------------------- keys
def test_encode_key_is_sorted_compact_json() -> None:
    assert encode_key({"region": "eu", "order_id": 42}) == b'{"order_id":42,"region":"eu"}'


def test_encode_key_is_independent_of_column_order() -> None:
    assert encode_key({"a": 1, "b": "x"}) == encode_key({"b": "x", "a": 1})


def test_encode_key_is_utf8_not_ascii_escaped() -> None:
    encoded = encode_key({"name": "Zoë", "city": "東京"})

    assert encoded == '{"city":"東京","name":"Zoë"}'.encode()
    assert json.loads(encoded.decode("utf-8")) == {"name": "Zoë", "city": "東京"}


# ---------------------------------------------------------------------------------------------- values
def test_encode_value_upsert_carries_every_field() -> None:
    change = Change(
        key={"order_id": 1},
        data={"order_id": 1, "amount": 9.5},
        seq=7,
        ts_ms=1_700_000_000_000,
        table="orders",
    )

    value = encode_value(change)

    assert value is not None
    assert json.loads(value) == {
        "op": "upsert",
        "seq": 7,
        "ts_ms": 1_700_000_000_000,
        "table": "orders",
        "data": {"order_id": 1, "amount": 9.5},
    }
    assert b" " not in value  # compact


def test_encode_value_omits_optional_fields_that_are_unset() -> None:
    value = encode_value(Change(key={"id": 3}, data={"id": 3, "status": "new"}))

    assert value is not None
    assert json.loads(value) == {"op": "upsert", "data": {"id": 3, "status": "new"}}


def test_encode_value_delete_has_null_data() -> None:
    value = encode_value(Change(key={"order_id": 1}, op="delete", seq=8, ts_ms=5, table="orders"))

    assert value is not None
    assert json.loads(value) == {"op": "delete", "seq": 8, "ts_ms": 5, "table": "orders", "data": None}


def test_encode_value_of_a_tombstone_is_none() -> None:
    assert encode_value(Change(key={"order_id": 1}, op="delete", tombstone=True)) is None


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": {}, "data": {"id": 1}}, "key column"),
        ({"key": {"id": 1}, "op": "merge", "data": {"id": 1}}, "op must be one of"),
        ({"key": {"id": 1}, "op": "upsert"}, "full row in data"),
        ({"key": {"id": 1, "region": "eu"}, "data": {"id": 1}}, "missing ['region']"),
        ({"key": {"id": 1}, "op": "delete", "data": {"id": 1}}, "a delete carries no data"),
        ({"key": {"id": 1}, "data": {"id": 1}, "seq": True}, "seq must be an integer"),
        ({"key": {"id": 1}, "data": {"id": 1}, "seq": "7"}, "seq must be an integer"),
        ({"key": {"id": 1}, "data": {"id": 1}, "ts_ms": 1.5}, "ts_ms must be an integer"),
        ({"key": {"id": 1}, "op": "delete", "tombstone": True, "seq": 3}, "tombstone"),
        ({"key": {"id": 1}, "op": "delete", "tombstone": True, "ts_ms": 3}, "tombstone"),
        ({"key": {"id": 1}, "op": "delete", "tombstone": True, "table": "orders"}, "tombstone"),
        ({"key": {"id": 1}, "data": {"id": 1}, "tombstone": True}, "a tombstone is a delete"),
    ],
)
def test_invalid_changes_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Change(**kwargs)


# ---------------------------------------------------------------------------------------------- settings
def test_client_config_forces_safety_and_partitioner() -> None:
    conf = ProducerSettings().client_config(CONNECTION)

    assert conf["enable.idempotence"] is True
    assert conf["acks"] == "all"
    assert 1 <= conf["max.in.flight.requests.per.connection"] <= 5
    assert conf["partitioner"] == "murmur2_random"
    assert conf["allow.auto.create.topics"] is False
    assert conf["bootstrap.servers"] == "127.0.0.1:9092"
    assert conf["security.protocol"] == "PLAINTEXT"
    assert "transactional.id" not in conf
    assert "transaction.timeout.ms" not in conf


def test_client_config_passes_batching_knobs() -> None:
    settings = ProducerSettings(
        linger_ms=20,
        batch_size=65_536,
        compression="zstd",
        delivery_timeout_ms=30_000,
        extra=(("client.id", "orders-service"),),
    )

    conf = settings.client_config(CONNECTION)

    assert conf["linger.ms"] == 20
    assert conf["batch.size"] == 65_536
    assert conf["compression.type"] == "zstd"
    assert conf["delivery.timeout.ms"] == 30_000
    assert conf["client.id"] == "orders-service"


def test_client_config_sets_transactional_id_only_when_given() -> None:
    conf = ProducerSettings(transactional_id="orders-1", transaction_timeout_ms=45_000).client_config(CONNECTION)

    assert conf["transactional.id"] == "orders-1"
    assert conf["transaction.timeout.ms"] == 45_000
    # librdkafka refuses a delivery timeout longer than the transaction timeout
    assert conf["delivery.timeout.ms"] == 45_000
    assert conf["enable.idempotence"] is True


@pytest.mark.parametrize(
    "key",
    [
        "acks",
        "request.required.acks",
        "enable.idempotence",
        "max.in.flight.requests.per.connection",
        "max.in.flight",
        "partitioner",
        "transactional.id",
        "allow.auto.create.topics",
    ],
)
def test_extra_cannot_override_fixed_properties(key: str) -> None:
    with pytest.raises(ValueError, match="cannot be overridden"):
        ProducerSettings(extra=((key, "1"),))


@pytest.mark.parametrize("compression", ["brotli", "LZ4", ""])
def test_unknown_compression_is_rejected(compression: str) -> None:
    with pytest.raises(ValueError, match="compression must be one of"):
        ProducerSettings(compression=compression)


@pytest.mark.parametrize("field", ["linger_ms", "batch_size", "delivery_timeout_ms", "transaction_timeout_ms"])
def test_negative_sizes_are_rejected(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must not be negative"):
        ProducerSettings(**{field: -1})  # type: ignore[arg-type]


def test_connect_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="connect_timeout_s"):
        ProducerSettings(connect_timeout_s=0)


@pytest.mark.parametrize(
    "settings",
    [
        {"linger_ms": 1000, "delivery_timeout_ms": 1000},
        {"linger_ms": 50_000, "transactional_id": "orders-1", "transaction_timeout_ms": 40_000},
    ],
)
def test_linger_must_stay_below_the_delivery_timeout(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="linger_ms"):
        ProducerSettings(**settings)
