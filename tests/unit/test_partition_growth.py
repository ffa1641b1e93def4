"""replica_lib.recovery.check_partitions: a topic that gains partitions under a table ordered by log position."""

from __future__ import annotations

from typing import Any

import pytest

from replica_lib.config import ReplicaConfig, parse_replica
from replica_lib.errors import PartitionsChangedError
from replica_lib.recovery import check_partitions


def replica(**tables: dict[str, Any]) -> ReplicaConfig:
    doc = {
        "replica": {"name": "r", "checkpoint": "/unused/cp", "quarantine": {"path": "/unused/q"}},
        "kafka": {"bootstrap_servers": "unused:9092"},
        "tables": {
            name: {"keys": ["id"], "schema": "id BIGINT", "target": {"path": f"/unused/{name}"}, **spec}
            for name, spec in tables.items()
        },
    }
    return parse_replica(doc, "r.toml", {})


def test_a_topic_that_gained_partitions_after_records_stops_the_tables_ordered_by_log_position() -> None:
    cfg = replica(a={"topic": "t"}, b={"topic": "t"}, c={"topic": "t", "sequence_by": "seq"}, d={"topic": "u"})
    with pytest.raises(PartitionsChangedError) as caught:
        check_partitions(cfg, {"t": {0: 5, 1: 0}, "u": {0: 3}}, {"t": [0, 1, 2], "u": [0]}, "seen at batch 7")
    message = str(caught.value)
    assert message.startswith("replica r: topic t has gained partitions 2 (from 2 to 3, seen at batch 7): ")
    assert "a, b are ordered by log position (no sequence_by in r.toml)" in message


@pytest.mark.parametrize(
    ("before", "now"),
    [
        ({"t": {0: 0, 1: 0}}, {"t": [0, 1, 2]}),  # no record was written before: no key moved
        ({"t": {0: 5, 1: 2}}, {"t": [0, 1]}),  # the same partitions
        ({}, {"t": [0, 1, 2]}),  # nothing known of the topic yet
    ],
)
def test_no_key_moved_goes_on(before: dict[str, dict[int, int]], now: dict[str, list[int]]) -> None:
    check_partitions(replica(a={"topic": "t"}), before, now, "seen at batch 1")


def test_a_table_with_a_sequence_goes_on_when_its_topic_gains_partitions() -> None:
    check_partitions(replica(a={"topic": "t", "sequence_by": "seq"}), {"t": {0: 9}}, {"t": [0, 1]}, "seen at batch 1")
