"""Merge-on-read: the state a reader sees, before and after each fold, equals the reference model; so does the base."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from pyspark.sql import SparkSession

from replica_dev.model import LoggedChange
from replica_lib.config import MERGE_ON_READ, ReplicaConfig
from replica_lib.layout import FOLD_POINTS, fold
from replica_lib.producer import Change
from replica_lib.target import changes_target, read_table, table_schema
from tests.integration.support import (
    delete,
    expected_df,
    orders_table,
    produce,
    replica_config,
    replica_df,
    run_available_now,
    tombstone,
    upsert,
)

pytestmark = pytest.mark.integration


def merge_on_read(topic: str, fold_every_batches: int = 0) -> dict[str, Any]:
    return orders_table(topic, layout=MERGE_ON_READ, fold_every_batches=fold_every_batches)


def assert_state(spark: SparkSession, cfg: ReplicaConfig, log: list[LoggedChange]) -> None:
    actual = sorted(tuple(r) for r in replica_df(spark, cfg, "orders").collect())
    expected = sorted(tuple(r) for r in expected_df(spark, cfg, "orders", log).collect())
    assert actual == expected, (
        f"rows not in the model: {sorted(set(actual) - set(expected))}; "
        f"rows of the model missing: {sorted(set(expected) - set(actual))}"
    )


def assert_folded(spark: SparkSession, cfg: ReplicaConfig, log: list[LoggedChange]) -> None:
    """The base alone is the state, and nothing is pending."""
    table = cfg.table("orders")
    base = read_table(spark, table.target).drop("_src_event_ts")
    assert_df_equality(base, expected_df(spark, cfg, "orders", log), ignore_row_order=True)
    assert read_table(spark, changes_target(table)).count() == 0


def pending(spark: SparkSession, cfg: ReplicaConfig) -> int:
    return read_table(spark, changes_target(cfg.table("orders"))).count()


class Crash(Exception):
    pass


def crash_at(point: str) -> Any:
    def at(reached: str) -> None:
        if reached == point:
            raise Crash(point)

    return at


def test_the_state_equals_the_model_before_and_after_a_fold_and_a_fold_killed_anywhere(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic = topic_factory(partitions=3)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "mor", {"orders": merge_on_read(topic)})
    schema = table_schema(cfg.table("orders"), cfg.source_file)
    first: list[Change] = [
        upsert(1, 1, "new"),
        upsert(1, 4, "shipped"),
        upsert(1, 2, "paid"),
        upsert(2, 5, "v5"),
        upsert(3, 1, "v1"),
        delete(3, 2),
        upsert(4, 1, "v1"),
        delete(4, 2),
        upsert(5, 3, "v3"),
        tombstone(5),  # a Kafka tombstone on a sequenced table: inherits seq 3
        delete(6, 1),
    ]
    log = produce(connection, topic, first)
    log += produce(connection, topic, first)  # delivered twice
    run_available_now(spark, cfg)
    assert_state(spark, cfg, log)
    assert read_table(spark, cfg.table("orders").target).count() == 0  # nothing folded yet: all of it pending
    assert pending(spark, cfg) > 0

    folded = fold(spark, cfg.name, schema)
    assert folded.version is not None and folded.keys == 6
    assert_folded(spark, cfg, log)
    assert_state(spark, cfg, log)

    second: list[Change] = [
        upsert(2, 4, "v4-late"),  # older than the folded seq 5
        upsert(3, 1, "v1-late"),  # older than the folded delete: no resurrection
        upsert(4, 3, "v3-newer"),  # newer than the delete: back
        upsert(5, 2, "v2-late"),  # older than the seq the tombstone inherited
        upsert(6, 2, "v2"),
        tombstone(2),  # inherits seq 5 from the base row
        upsert(2, 5, "v5-again"),  # equal seq, later in the log: after the tombstone
    ]
    log += produce(connection, topic, second)
    run_available_now(spark, cfg)
    assert_state(spark, cfg, log)

    # A fold killed at each of its points: readers still see the state, and the next fold completes it.
    for point in FOLD_POINTS:
        with pytest.raises(Crash):
            fold(spark, cfg.name, schema, at=crash_at(point))
        assert_state(spark, cfg, log)
        log += produce(connection, topic, [upsert(7, len(log), f"after-{point}"), delete(4, 9)])
        run_available_now(spark, cfg)
        assert_state(spark, cfg, log)
    fold(spark, cfg.name, schema)
    assert_folded(spark, cfg, log)
    assert fold(spark, cfg.name, schema).version is None  # nothing pending: a no-op


def test_a_seeded_random_run_with_folds_between_batches_equals_the_model(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """3,000 events over 200 keys (late seqs, duplicates, deletes, tombstones), folded every 3rd batch."""
    rng = random.Random(20261125)
    topic = topic_factory(partitions=4)
    cfg = replica_config(
        tmp_path,
        connection["bootstrap.servers"],
        "mor_random",
        {"orders": merge_on_read(topic, fold_every_batches=3)},
        max_offsets_per_trigger=rng.randint(400, 800),
    )
    keys = 200
    next_seq = dict.fromkeys(range(keys), 0)
    changes: list[Change] = []
    for _ in range(3_000):
        key = rng.randrange(keys)
        next_seq[key] += 1
        seq = max(1, next_seq[key] - rng.choice((0, 0, 0, 1, 2)))
        roll = rng.random()
        if roll < 0.15:
            changes.append(delete(key, seq))
        elif roll < 0.2:
            changes.append(tombstone(key))
        else:
            changes.append(upsert(key, seq, f"s{seq}", amount=round(rng.uniform(1, 100), 2)))
        if rng.random() < 0.05:
            changes.append(changes[-1])
    log: list[LoggedChange] = []
    position = 0
    while position < len(changes):
        size = rng.randint(400, 1_500)
        log += produce(connection, topic, changes[position : position + size])
        position += size
        run_available_now(spark, cfg)
        assert_state(spark, cfg, log)
    fold(spark, cfg.name, table_schema(cfg.table("orders"), cfg.source_file))
    assert_folded(spark, cfg, log)
