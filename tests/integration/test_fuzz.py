"""End to end: a seeded mix of valid and malformed records on a real topic; the table is the model of the valid ones."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from replica_dev.model import LoggedChange
from replica_lib.producer import Change, Position
from replica_lib.target import read_table
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import orders_table, replica_config, run_available_now
from tests.integration.test_semantics import assert_matches_model, produce_raw
from tests.unit.test_decode_fuzz import Fuzz

pytestmark = pytest.mark.integration

SEED = 14
RECORDS = 300


def test_fuzzed_records_quarantine_exactly_the_bad_ones(
    spark: SparkSession, connection: dict[str, str], tmp_path: Path
) -> None:
    # One partition, so offsets are the write order; no compaction, so the broker keeps records without a key.
    topic = f"fuzz-{uuid.uuid4().hex[:8]}"
    TopicAdmin(connection).ensure(TopicSpec.local(topic, partitions=1, compact=False), local=True)
    fuzz = Fuzz(SEED, big=100_000)
    records: list[tuple[bytes | None, bytes | None]] = []
    log: list[LoggedChange] = []
    bad: dict[int, tuple[bytes | None, bytes | None]] = {}
    for offset in range(RECORDS):
        if fuzz.rng.random() < 0.6:
            key, value, row = fuzz.valid(offset)
            order_id, customer, amount, status, updated_ms, op, seq, is_tombstone, _ = row
            data = None
            if op == "upsert":
                data = {
                    "order_id": order_id,
                    "customer": customer,
                    "amount": amount,
                    "status": status,
                    "updated_ms": updated_ms,
                }
            change = Change(key={"order_id": order_id}, op=op, data=data, seq=seq, tombstone=is_tombstone)
            log.append(LoggedChange(Position(topic, 0, offset), change, "orders"))
        else:
            key, value = fuzz.bad()
            bad[offset] = (key, value)
        records.append((key, value))
    produce_raw(connection, topic, records)

    # This test is of what decoding rejects: skip, not hold (holding is tested in test_quarantine.py), and strict,
    # so a field the schema lacks (some valid records have one) is counted, not added (see test_evolution.py).
    table = orders_table(topic, on_poison="skip", schema_evolution="strict")
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "fuzz", {"orders": table})
    run_available_now(spark, cfg)

    assert_matches_model(spark, cfg, log)
    quarantine = read_table(spark, cfg.quarantine).collect()
    got = {
        r["offset"]: (None if r["key"] is None else bytes(r["key"]), None if r["value"] is None else bytes(r["value"]))
        for r in quarantine
    }
    assert got == bad
    assert len(quarantine) == len(bad)
    assert all(r["topic"] == topic and r["partition"] == 0 and r["reason"] for r in quarantine)
