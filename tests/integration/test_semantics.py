"""The materializer's semantics on a real broker, Spark and Delta, checked against the reference model."""

from __future__ import annotations

import dataclasses
import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from confluent_kafka import Producer
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_dev.model import LoggedChange
from replica_lib import merge, stream
from replica_lib.config import CompactionConfig, ReplicaConfig, Target
from replica_lib.maintenance import compact_tombstones
from replica_lib.producer import Change, ChangeProducer, ProducerSettings
from replica_lib.progress import applied_offsets
from replica_lib.target import delta_table, read_table, tombstone_target
from replica_lib.topics import TopicAdmin, TopicSpec
from tests.integration.support import (
    delete,
    end_offsets,
    expected_df,
    orders_table,
    produce,
    produce_garbage,
    replica_config,
    replica_df,
    run_available_now,
    tombstone,
    upsert,
)

pytestmark = pytest.mark.integration


def assert_matches_model(
    spark: SparkSession, cfg: ReplicaConfig, log: list[LoggedChange], table: str = "orders"
) -> None:
    assert_df_equality(
        replica_df(spark, cfg, table),
        expected_df(spark, cfg, table, log),
        ignore_row_order=True,
        ignore_nullable=True,
    )


def rows_by_key(spark: SparkSession, cfg: ReplicaConfig, table: str = "orders") -> dict[int, dict[str, Any]]:
    return {row["order_id"]: row.asDict() for row in replica_df(spark, cfg, table).collect()}


@pytest.mark.parametrize("deletion_vectors", [False, True], ids=["rewrite", "deletion-vectors"])
def test_a_merge_rewrites_or_marks_the_rows_it_replaces_and_both_equal_the_model(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    deletion_vectors: bool,
) -> None:
    # The size above which a MERGE writes deletion vectors: 0 makes every MERGE write them, a huge one none.
    monkeypatch.setattr(merge, "REWRITE_MAX_BYTES", 0 if deletion_vectors else 1 << 60)
    topic = topic_factory(partitions=2)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "dvs", {"orders": orders_table(topic)})
    log = produce(connection, topic, [upsert(k, 1, "v1") for k in range(40)])
    run_available_now(spark, cfg)
    changes = [upsert(k, 2, "v2") for k in range(0, 40, 3)] + [delete(k, 2) for k in range(1, 40, 5)]
    changes += [upsert(k, 0, "stale") for k in range(2, 40, 7)] + [upsert(k, 1, "new") for k in range(40, 45)]
    log += produce(connection, topic, changes)
    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)

    last = delta_table(spark, cfg.table("orders").target).history(1).collect()[0]
    assert last["operation"] == "MERGE"
    metrics = last["operationMetrics"]
    assert int(metrics["numTargetRowsUpdated"]) > 0 and int(metrics["numTargetRowsDeleted"]) > 0
    assert (int(metrics.get("numTargetDeletionVectorsAdded", "0")) > 0) == deletion_vectors
    assert (int(metrics.get("numTargetRowsCopied", "0")) > 0) == (not deletion_vectors)


@pytest.mark.parametrize("retained", ["broadcast whole", "of the batch's keys"])
def test_ordering_deletes_and_duplicates_across_batches(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, monkeypatch: Any, retained: str
) -> None:
    from replica_lib import batch

    if retained != "broadcast whole":  # the anti join against the retained deletes of a large tombstone table
        monkeypatch.setattr(batch, "RETAINED_BROADCAST_ROWS", -1)
    topic = topic_factory(partitions=3)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "semantics", {"orders": orders_table(topic)})
    first = [
        # 1: many events for one key in one batch, out of order within the batch: seq 4 wins
        upsert(1, 1, "new"),
        upsert(1, 4, "shipped"),
        upsert(1, 2, "paid"),
        upsert(1, 3, "packed"),
        # 2: out of order across batches (the older seq arrives in the next batch)
        upsert(2, 5, "v5"),
        # 3: deleted now; an older upsert arrives late (next batch) and must not resurrect it
        upsert(3, 1, "v1"),
        delete(3, 2),
        # 4: deleted now; a newer upsert arrives next batch and re-inserts it
        upsert(4, 1, "v1"),
        delete(4, 2),
        # 5: a Kafka tombstone deletes it (and inherits seq 3 for later comparisons)
        upsert(5, 3, "v3"),
        tombstone(5),
        # 6: a delete of a key never seen, then nothing
        delete(6, 1),
    ]
    log = produce(connection, topic, first)
    log += produce(connection, topic, first)  # the same records produced twice
    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)
    assert sorted(rows_by_key(spark, cfg)) == [1, 2]
    assert rows_by_key(spark, cfg)[1]["status"] == "shipped"

    second = [
        upsert(2, 4, "v4-late"),  # older than the applied seq 5: ignored
        upsert(3, 1, "v1-late"),  # older than the delete: no resurrection
        upsert(4, 3, "v3-newer"),  # newer than the delete: re-inserted
        upsert(5, 2, "v2-late"),  # older than the seq the tombstone inherited (3): stays deleted
        upsert(6, 2, "v2"),  # newer than the delete of a never-seen key: inserted
    ]
    log += produce(connection, topic, second)
    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)
    rows = rows_by_key(spark, cfg)
    assert sorted(rows) == [1, 2, 4, 6]
    assert (rows[2]["status"], rows[4]["status"], rows[6]["status"]) == ("v5", "v3-newer", "v2")
    assert rows[4]["_src_seq"] == 3

    def retained() -> list[int]:
        return sorted(r["order_id"] for r in read_table(spark, tombstone_target(cfg.table("orders"))).collect())

    # The tombstone log keeps every applied delete; 4 and 6 were upserted again since: maintenance drops theirs.
    assert retained() == [3, 4, 5, 6]
    assert compact_tombstones(spark, cfg.table("orders")) == 2
    assert retained() == [3, 5]
    log += produce(connection, topic, [upsert(3, 1, "v1-later"), upsert(4, 2, "v2-later"), upsert(6, 1, "v1")])
    run_available_now(spark, cfg)  # all older than what counts for their key: nothing changes
    assert_matches_model(spark, cfg, log)
    assert rows_by_key(spark, cfg) == rows


@pytest.mark.parametrize("layout", ["copy-on-write", "merge-on-read"])
def test_a_table_without_a_sequence_is_ordered_by_the_log_whatever_seq_its_records_carry(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, layout: str
) -> None:
    # No sequence_by: the log position decides, and a producer's seq is not read (README, the contract's Order).
    topic = topic_factory(partitions=1)
    table = {k: v for k, v in orders_table(topic, layout=layout).items() if k != "sequence_by"}
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "by_log", {"orders": table})
    log = produce(
        connection,
        topic,
        [
            upsert(1, 5, "first"),
            upsert(1, 2, "second"),  # later in the log: wins
            upsert(2, 5, "v5"),
            tombstone(2),  # deletes it at its place in the log
            upsert(3, 9, "v9"),
            delete(3, 1),
        ],
    )
    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)
    assert {k: r["status"] for k, r in rows_by_key(spark, cfg).items()} == {1: "second"}
    log += produce(connection, topic, [upsert(1, 1, "third"), upsert(2, 0, "back"), upsert(3, 0, "again")])
    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)
    assert {k: r["status"] for k, r in rows_by_key(spark, cfg).items()} == {1: "third", 2: "back", 3: "again"}


def test_records_delivered_twice_in_a_batch_are_applied_once(
    spark: SparkSession,
    connection: dict[str, str],
    topic_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every batch handed to the handler holds each record twice: the tables must be as if it held them once."""

    class Doubling(stream.BatchHandler):
        def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
            super().__call__(batch_df.unionAll(batch_df), batch_id)

    monkeypatch.setattr(stream, "BatchHandler", Doubling)
    topic = topic_factory(partitions=2)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "twice", {"orders": orders_table(topic)})
    log = produce(
        connection,
        topic,
        [upsert(1, 1, "a"), upsert(1, 2, "b"), delete(2, 3), upsert(3, 1, "c"), tombstone(3), upsert(4, 1, "d")],
    )
    produce_raw(connection, topic, [(b'{"order_id": 9}', b"not json")])
    run_available_now(spark, cfg)
    log += produce(connection, topic, [upsert(4, 2, "e"), delete(1, 3), upsert(2, 1, "late")])
    run_available_now(spark, cfg)

    assert_matches_model(spark, cfg, log)
    assert read_table(spark, cfg.quarantine).count() == 1
    tombstones = read_table(spark, tombstone_target(cfg.table("orders")))
    assert sorted(r["order_id"] for r in tombstones.collect()) == [1, 2, 3]


def test_key_ranges_of_dates_and_decimals(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """A batch's key range bounds the MERGE and the read of rows for Kafka tombstones, in the key's own type.

    One replica applies both key types (a table each, on its own topic) in the same runs.
    """
    typed: dict[str, tuple[str, list[Any]]] = {
        "dates": ("DATE", ["2026-01-01", "2026-01-02", "2026-01-03", "2026-01-04", "2026-01-05"]),
        "decimals": ("DECIMAL(12,2)", [10.25, 20.5, 30.75, 40.0, 50.01]),
    }
    topics = {name: topic_factory(partitions=2) for name in typed}
    tables = {
        name: {"topic": topics[name], "keys": ["k"], "sequence_by": "seq", "schema": f"k {key_type}, status STRING"}
        for name, (key_type, _) in typed.items()
    }
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "typed_keys", tables)

    def change(table: str, key: Any, seq: int, status: str | None) -> Change:
        if status is None:
            return Change(key={"k": key}, op="delete", seq=seq, table=table)
        return Change(key={"k": key}, op="upsert", data={"k": key, "status": status}, seq=seq, table=table)

    for name, (_, keys) in typed.items():
        produce(connection, topics[name], [change(name, key, 1, "v1") for key in keys], name)
    run_available_now(spark, cfg)
    for name, (_, keys) in typed.items():
        tombstone_of_fourth = Change(key={"k": keys[3]}, op="delete", tombstone=True)
        second = [
            change(name, keys[1], 2, "v2"),
            change(name, keys[2], 2, None),
            tombstone_of_fourth,
            change(name, keys[4], 0, "late"),
        ]
        produce(connection, topics[name], second, name)
    run_available_now(spark, cfg)
    for name, (_, keys) in typed.items():
        # Older than the seq the tombstone took (1).
        produce(connection, topics[name], [change(name, keys[3], 0, "late")], name)
    run_available_now(spark, cfg)

    for name, (key_type, keys) in typed.items():
        rows = {str(r["k"]): (r["status"], r["_src_seq"]) for r in read_table(spark, cfg.table(name).target).collect()}
        as_text = [str(key) if key_type == "DATE" else f"{key:.2f}" for key in keys]
        assert rows == {as_text[0]: ("v1", 1), as_text[1]: ("v2", 2), as_text[4]: ("v1", 1)}, name


def test_a_table_compacted_between_runs_goes_on_exactly(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OPTIMIZE packs a replica table's small files (and its tombstone table's) between two runs: nothing changes."""
    from replica_dev import loadgen

    # Small files pile up where MERGEs write deletion vectors (a large table); this small one would be rewritten.
    monkeypatch.setattr(merge, "REWRITE_MAX_BYTES", 0)

    topic = topic_factory(partitions=2)
    orders = {"orders": orders_table(topic)}
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "compacted", orders, max_offsets_per_trigger=40)
    # The second workload's seqs start again at 1: late changes, which this producer must write.
    with ChangeProducer(connection, ProducerSettings(on_lower_seq="allow")) as producer:
        log = loadgen.run(producer, topic, loadgen.Workload(keys=40, events=120, seed=3))
        run_available_now(spark, cfg)  # 3 batches: a first append, then MERGEs
        table, tombstones = (
            delta_table(spark, cfg.table("orders").target),
            delta_table(spark, tombstone_target(cfg.table("orders"))),
        )
        files_before = table.detail().first()["numFiles"]
        table.optimize().executeCompaction()
        tombstones.optimize().executeCompaction()
        assert table.detail().first()["numFiles"] < files_before
        assert_matches_model(spark, cfg, log)
        log += loadgen.run(producer, topic, loadgen.Workload(keys=40, events=80, seed=4))
    run_available_now(spark, cfg)  # 2 batches, both MERGEs on the compacted version

    assert_matches_model(spark, cfg, log)
    operations = [r["operation"] for r in table.history().collect()]
    assert operations.count("OPTIMIZE") == 1 and operations.count("MERGE") >= 4, operations
    applied = applied_offsets(spark, cfg.table("orders").target)
    assert applied is not None and applied.offsets == {topic: end_offsets(log)}


def test_the_replica_packs_its_small_files_every_n_batches(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After every 2nd batch by id, across runs, the replica OPTIMIZEs its tables; no row or offset changes, and
    a re-run of a batch that compacted commits nothing (its writes are skipped, no small file is left)."""
    from replica_dev import loadgen

    # Small files pile up where MERGEs write deletion vectors (a large table); this small one would be rewritten.
    monkeypatch.setattr(merge, "REWRITE_MAX_BYTES", 0)

    topic = topic_factory(partitions=2)
    cfg = replica_config(
        tmp_path,
        connection["bootstrap.servers"],
        "packing",
        {"orders": orders_table(topic)},
        max_offsets_per_trigger=40,
    )
    cfg = dataclasses.replace(cfg, compaction=CompactionConfig(every_batches=2, small_file_mb=16))
    # The second workload's seqs start again at 1: late changes, which this producer must write.
    with ChangeProducer(connection, ProducerSettings(on_lower_seq="allow")) as producer:
        log = loadgen.run(producer, topic, loadgen.Workload(keys=40, events=120, seed=5))
        run_available_now(spark, cfg)  # batches 0-2
        assert_matches_model(spark, cfg, log)
        log += loadgen.run(producer, topic, loadgen.Workload(keys=40, events=40, seed=6))
    run_available_now(spark, cfg)  # batch 3: the run's first batch compacts, by its id

    def compactions(target: Target) -> list[tuple[int, int, int]]:
        """(batch id of the commit before, files removed, files added) of each OPTIMIZE, in order."""
        found, batch = [], -1
        for row in delta_table(spark, target).history().orderBy("version").collect():
            if row["operation"] == "OPTIMIZE":
                metrics = row["operationMetrics"]
                found.append((batch, int(metrics["numRemovedFiles"]), int(metrics["numAddedFiles"])))
            elif row["userMetadata"]:
                batch = json.loads(row["userMetadata"])["batch_id"]
        return found

    packed = compactions(cfg.table("orders").target)
    assert [batch for batch, _, _ in packed] == [1, 3], packed
    assert all(removed >= 2 and added == 1 for _, removed, added in packed), packed
    assert [batch for batch, _, _ in compactions(tombstone_target(cfg.table("orders")))][:1] == [1]
    assert_matches_model(spark, cfg, log)
    applied = applied_offsets(spark, cfg.table("orders").target)
    assert applied is not None and applied.offsets == {topic: end_offsets(log)}

    version = delta_table(spark, cfg.table("orders").target).history(1).first()["version"]  # type: ignore[index]
    (Path(cfg.checkpoint) / "commits" / "3").unlink()  # as if the process died after batch 3's compaction
    (Path(cfg.checkpoint) / "commits" / ".3.crc").unlink(missing_ok=True)
    run_available_now(spark, cfg)
    assert delta_table(spark, cfg.table("orders").target).history(1).first()["version"] == version  # type: ignore[index]
    assert_matches_model(spark, cfg, log)


def test_rerun_of_a_committed_batch_changes_nothing(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """Spark re-executes the last batch when its commit log entry is missing (a crash after the Delta commit)."""
    from delta.tables import DeltaTable

    topic = topic_factory(partitions=2)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "rerun", {"orders": orders_table(topic)})
    log = produce(connection, topic, [upsert(k, 1, "a") for k in range(20)] + [delete(3, 2), upsert(4, 2, "b")])
    produce_raw(connection, topic, [(b'{"order_id": 99}', b"not json")])
    run_available_now(spark, cfg)
    target = cfg.table("orders").target.path or ""
    version_before = DeltaTable.forPath(spark, target).history(1).collect()[0]["version"]
    before_df = replica_df(spark, cfg, "orders").localCheckpoint()
    quarantined_before = read_table(spark, cfg.quarantine).count()

    commits = sorted((Path(cfg.checkpoint) / "commits").glob("[0-9]*"), key=lambda p: int(p.name))
    assert commits, "the run committed no batch"
    commits[-1].unlink()  # Spark now believes the last batch never finished
    (commits[-1].parent / f".{commits[-1].name}.crc").unlink(missing_ok=True)
    run_available_now(spark, cfg)

    assert DeltaTable.forPath(spark, target).history(1).collect()[0]["version"] == version_before
    assert_df_equality(replica_df(spark, cfg, "orders"), before_df, ignore_row_order=True)
    assert read_table(spark, cfg.quarantine).count() == quarantined_before == 1
    assert_matches_model(spark, cfg, log)


def produce_raw(connection: dict[str, str], topic: str, records: list[tuple[bytes | None, bytes | None]]) -> None:
    """Write records byte for byte (for malformed input and foreign formats)."""
    producer = Producer({**connection, "enable.idempotence": True, "partitioner": "murmur2_random"})
    errors: list[str] = []
    for key, value in records:
        producer.produce(topic, key=key, value=value, on_delivery=lambda err, _msg: err and errors.append(str(err)))
        producer.flush(30)  # one at a time: keep the write order, and one rejected record fails alone
    assert errors == []


def test_aborted_transaction_is_never_applied(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic = topic_factory(partitions=2)
    log = produce(connection, topic, [upsert(1, 1, "committed"), upsert(2, 1, "committed")], transactional_id="t-ok")
    producer = ChangeProducer(connection, ProducerSettings(transactional_id="t-abort"))
    with pytest.raises(RuntimeError), producer, producer.transaction():
        producer.upsert(topic, {"order_id": 1}, upsert(1, 9, "aborted").data or {}, seq=9)
        producer.upsert(topic, {"order_id": 3}, upsert(3, 9, "aborted").data or {}, seq=9)
        producer.flush()
        raise RuntimeError("the primary's transaction fails")
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "txn", {"orders": orders_table(topic)})
    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)
    assert {k: r["status"] for k, r in rows_by_key(spark, cfg).items()} == {1: "committed", 2: "committed"}
    assert read_table(spark, cfg.quarantine).count() == 0


def test_malformed_records_are_quarantined_and_the_rest_applied(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    # One partition, so offsets are the write order; cleanup.policy=delete, because a compacted topic makes the
    # broker itself reject records without a key.
    topic = f"bad-{uuid.uuid4().hex[:8]}"
    TopicAdmin(connection).ensure(TopicSpec.local(topic, partitions=1, compact=False), local=True)
    good = json.dumps(
        {
            "op": "upsert",
            "seq": 1,
            "data": {"order_id": 1, "customer": "a", "amount": 1.5, "status": "ok", "updated_ms": 1},
        }
    ).encode()
    bad = [
        (b'{"order_id": 2}', b"{not json"),
        (None, good),
        (b'{"order_id": 3}', b'{"op": "merge", "seq": 1, "data": {"order_id": 3}}'),
        (b'{"order_id": 4}', b'{"op": "upsert", "seq": 1, "data": {"order_id": 4, "amount": "lots"}}'),
        (b'{"order_id": 5}', b'{"op": "upsert", "data": {"order_id": 5}}'),
        (b'{"id": 6}', good),
        (b'{"order_id": 7}', b'{"op": "upsert", "seq": 1, "table": "payments", "data": {"order_id": 7}}'),
        (b'{"order_id": 8}', b'{"op": "upsert", "seq": 1, "data": {"order_id": 9}}'),
    ]
    records = [(b'{"order_id": 1}', good), *bad, (b'{"order_id": 1}', None)]
    produce_raw(connection, topic, records)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "bad", {"orders": orders_table(topic)})
    run_available_now(spark, cfg)

    quarantine = read_table(spark, cfg.quarantine).orderBy("offset")
    got = [
        (r["offset"], bytes(r["key"]) if r["key"] is not None else None, bytes(r["value"]), r["reason"])
        for r in quarantine.collect()
    ]
    reasons = {offset: reason for offset, _, _, reason in got}
    assert [offset for offset, *_ in got] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [(key, value) for _, key, value, _ in got] == [(k, v) for k, v in records[1:9]]
    assert "not a JSON object" in reasons[1]
    assert reasons[2].startswith("missing key")
    assert "unknown op 'merge'" in reasons[3]
    assert "amount (double)" in reasons[4]
    assert "missing sequence" in reasons[5]
    assert "key lacks a key column" in reasons[6]
    assert "unknown table 'payments'" in reasons[7]
    assert "does not match" in reasons[8]
    row = quarantine.where(F.col("offset") == 1).collect()[0]
    assert (row["replica"], row["topic"], row["partition"], row["table"]) == ("bad", topic, 0, "orders")
    # The valid upsert at offset 0 was applied, then deleted by the tombstone at offset 9.
    assert replica_df(spark, cfg, "orders").count() == 0
    tomb = read_table(spark, tombstone_target(cfg.table("orders")))
    assert [(r["order_id"], r["_src_offset"]) for r in tomb.collect()] == [(1, 9)]


def test_multi_table_topic_and_debezium_topic_in_one_replica(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    shared, cdc = topic_factory(partitions=2), topic_factory(partitions=1)
    customers = {
        "topic": shared,
        "keys": ["customer_id"],
        "sequence_by": "seq",
        "schema": "customer_id BIGINT, name STRING",
    }
    products = {"topic": cdc, "format": "debezium", "keys": ["id"], "schema": "id INT, name STRING, price DOUBLE"}
    cfg = replica_config(
        tmp_path,
        connection["bootstrap.servers"],
        "fanout",
        {"orders": orders_table(shared), "customers": customers, "products": products},
    )
    log = produce(
        connection,
        shared,
        [upsert(1, 1, "new", table="orders"), upsert(2, 1, "new", table="orders"), delete(2, 2, table="orders")],
    )
    produce(
        connection,
        shared,
        [Change(key={"customer_id": 7}, data={"customer_id": 7, "name": "ada"}, seq=1, table="customers")],
        table="customers",
    )

    def dbz(op: str, before: dict[str, Any] | None, after: dict[str, Any] | None, wrapped: bool) -> bytes:
        payload = {
            "before": before,
            "after": after,
            "op": op,
            "ts_ms": 1_700_000_000_000,
            "source": {"ts_ms": 1_700_000_000_000, "lsn": 1},
        }
        return json.dumps({"schema": {"type": "struct"}, "payload": payload} if wrapped else payload).encode()

    produce_raw(
        connection,
        cdc,
        [
            (b'{"id": 1}', dbz("r", None, {"id": 1, "name": "pen", "price": 1.5}, wrapped=False)),
            (b'{"schema": {}, "payload": {"id": 2}}', dbz("c", None, {"id": 2, "name": "ink", "price": 3.0}, True)),
            (b'{"id": 1}', dbz("u", {"id": 1}, {"id": 1, "name": "pen", "price": 2.0}, wrapped=True)),
            (b'{"id": 3}', dbz("c", None, {"id": 3, "name": "cap", "price": 0.5}, wrapped=False)),
            (b'{"id": 3}', dbz("d", {"id": 3, "name": "cap", "price": 0.5}, None, wrapped=False)),
            (b'{"id": 3}', None),
            (b'{"id": 4}', dbz("t", None, None, wrapped=False)),
        ],
    )
    run_available_now(spark, cfg)

    assert_matches_model(spark, cfg, log)
    customers_df = replica_df(spark, cfg, "customers").select("customer_id", "name", "_src_seq")
    assert [tuple(r) for r in customers_df.collect()] == [(7, "ada", 1)]
    products_df = replica_df(spark, cfg, "products").select("id", "name", "price").orderBy("id")
    assert [tuple(r) for r in products_df.collect()] == [(1, "pen", 2.0), (2, "ink", 3.0)]
    reasons = [r["reason"] for r in read_table(spark, cfg.quarantine).collect()]
    assert len(reasons) == 1 and "unsupported Debezium op 't'" in reasons[0]


def test_two_replicas_of_one_topic_converge(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    from replica_dev import loadgen
    from replica_lib.stream import start_replica

    topic = topic_factory(partitions=3)
    with ChangeProducer(connection) as producer:
        log = loadgen.run(producer, topic, loadgen.Workload(keys=80, events=800, seed=5))
    a = replica_config(tmp_path, connection["bootstrap.servers"], "conv_a", {"orders": orders_table(topic)})
    b = replica_config(
        tmp_path,
        connection["bootstrap.servers"],
        "conv_b",
        {"orders": orders_table(topic)},
        max_offsets_per_trigger=300,  # 3 batches where a takes 1
    )
    queries = [start_replica(spark, a, available_now=True), start_replica(spark, b, available_now=True)]
    try:
        for query in queries:
            assert query.awaitTermination(300)
    finally:
        for query in queries:
            query.stop()
    assert_matches_model(spark, a, log)
    assert_df_equality(replica_df(spark, a, "orders"), replica_df(spark, b, "orders"), ignore_row_order=True)


def test_the_tombstone_log_never_takes_the_merges_transaction(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """The MERGE's idempotence lives in its session's Delta write confs while it runs; the tombstone append, made
    without Delta's options, must not run then: it would commit the MERGE's transaction as its own, or fail when it
    saw one conf set and not the other."""
    topic = topic_factory(partitions=2)
    cfg = replica_config(
        tmp_path, connection["bootstrap.servers"], "apart", {"orders": orders_table(topic)}, max_offsets_per_trigger=40
    )
    changes = []
    for round_ in range(8):  # every batch upserts and deletes (no Kafka tombstones)
        for key in range(20):
            seq = 2 * round_ + 1
            changes.append(upsert(key, seq, f"r{round_}"))
            if key % 3 == round_ % 3:
                changes.append(delete(key, seq + 1))
    log = produce(connection, topic, changes)
    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)
    tombstones = tombstone_target(cfg.table("orders"))
    assert tombstones.path
    transactions = [
        action["txn"]
        for commit in sorted(Path(tombstones.path, "_delta_log").glob("*.json"))
        for action in map(json.loads, commit.read_text().splitlines())
        if "txn" in action
    ]
    assert transactions == []
    assert read_table(spark, tombstones).count() > 0  # the batches did append tombstones


def test_seeded_random_run_equals_the_model(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """5,000+ events over 250 keys: shuffled seqs, duplicates, deletes, tombstones, random batch boundaries."""
    from replica_lib import batch

    # The in-memory retained deletes compact often: this seed's second run (of two) is 3 batches, its last reading
    # the compacted state.
    monkeypatch.setattr(batch._Retained, "COMPACT_EVERY", 2)
    rng = random.Random(20261121)
    topic = topic_factory(partitions=4)
    cfg = replica_config(
        tmp_path,
        connection["bootstrap.servers"],
        "random",
        {"orders": orders_table(topic)},
        max_offsets_per_trigger=rng.randint(1200, 1800),
    )
    keys, events = 250, 5_200
    next_seq = dict.fromkeys(range(keys), 0)
    changes: list[Change] = []
    for _ in range(events):
        key = rng.randrange(keys)
        next_seq[key] += 1
        # Late delivery: a change sometimes carries an older seq than already sent for its key.
        seq = max(1, next_seq[key] - rng.choice((0, 0, 0, 0, 1, 2, 3)))
        roll = rng.random()
        if roll < 0.15:
            changes.append(delete(key, seq))
        elif roll < 0.2:
            changes.append(tombstone(key))
        else:
            changes.append(upsert(key, seq, f"s{seq}", amount=round(rng.uniform(1, 100), 2)))
        if rng.random() < 0.05:
            changes.append(changes[-1])  # produced twice
    log: list[LoggedChange] = []
    position = 0
    while position < len(changes):
        size = rng.randint(1_500, 4_000)
        log += produce(connection, topic, changes[position : position + size])
        position += size
        if rng.random() < 0.6 or position >= len(changes):
            run_available_now(spark, cfg)
            assert_matches_model(spark, cfg, log)
    assert len(log) >= 5_000


def test_retained_deletes_are_purged_only_when_expired_and_gone_from_the_log(
    spark: SparkSession, connection: dict[str, str], tmp_path: Path
) -> None:
    from datetime import UTC, datetime, timedelta

    from replica_lib.maintenance import purge_tombstones
    from replica_lib.quarantine import DROPPED, resolve, unresolved

    topic = f"purge-{uuid.uuid4().hex[:8]}"
    admin = TopicAdmin(connection)
    admin.ensure(TopicSpec.local(topic, partitions=1, compact=False), local=True)
    produce_garbage(connection, topic, partition=0)  # quarantined: a fix may replay it, older than what follows
    log = produce(connection, topic, [upsert(1, 1, "a"), upsert(2, 1, "a"), delete(1, 2), upsert(3, 1, "a")])
    log += produce(connection, topic, [delete(2, 2)])
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "purge", {"orders": orders_table(topic)})
    run_available_now(spark, cfg)
    tombstones = tombstone_target(cfg.table("orders"))

    def retained() -> list[int]:
        return sorted(r["order_id"] for r in read_table(spark, tombstones).collect())

    later = datetime.now(UTC) + timedelta(days=8)
    assert retained() == [1, 2]
    assert purge_tombstones(spark, cfg, admin) == {"orders": 0}  # not expired
    assert purge_tombstones(spark, cfg, admin, now=later) == {"orders": 0}  # expired, but the log holds it all
    delete_1_offset = log[2].position.offset
    admin.delete_records_before(topic, {0: delete_1_offset + 1})  # retention removed offsets 0..2
    assert purge_tombstones(spark, cfg, admin) == {"orders": 0}  # gone from the log, but not expired
    assert purge_tombstones(spark, cfg, admin, now=later) == {"orders": 0}  # the quarantine holds a record before it
    resolve(spark, cfg, unresolved(spark, cfg), DROPPED, "not a change")  # type: ignore[arg-type]
    assert purge_tombstones(spark, cfg, admin, now=later) == {"orders": 1}
    assert retained() == [2]
    # The delete of key 2 is still retained, so its older upsert arriving late stays ignored.
    log += produce(connection, topic, [upsert(2, 1, "late")])
    run_available_now(spark, cfg)
    assert_matches_model(spark, cfg, log)
    assert sorted(rows_by_key(spark, cfg)) == [3]


def test_maintenance_runs_beside_the_replica(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """Compaction deletes from the tombstone table while the replica appends to it: neither fails nor loses a delete.

    The replica's appends make Delta refuse some compaction MERGEs, which run again (here with room to spare: the
    test is about what they leave behind, not how often they are refused).
    """
    from dataclasses import replace

    from replica_lib import maintenance
    from replica_lib.config import TriggerConfig
    from replica_lib.stream import start_replica

    monkeypatch.setattr(maintenance, "ATTEMPTS", 100)

    topic = topic_factory(partitions=2)
    cfg = replica_config(
        tmp_path, connection["bootstrap.servers"], "beside", {"orders": orders_table(topic)}, max_offsets_per_trigger=30
    )
    cfg = replace(cfg, trigger=TriggerConfig(available_now=False, interval="0 seconds"))
    tombstones = tombstone_target(cfg.table("orders"))
    log: list[LoggedChange] = []
    query = start_replica(spark, cfg)
    try:
        # Each round deletes half the keys and upserts the other half, swapping halves: every round supersedes the
        # last and appends retained deletes, so every compaction runs beside the replica's appends.
        for seq in range(1, 4):
            log += produce(
                connection, topic, [delete(k, seq) if (k + seq) % 2 else upsert(k, seq, f"s{seq}") for k in range(40)]
            )
            compact_tombstones(spark, cfg.table("orders"))  # while the replica applies its batches
        query.processAllAvailable()
    finally:
        query.stop()
    assert_matches_model(spark, cfg, log)
    assert sorted(rows_by_key(spark, cfg)) == list(range(1, 40, 2))  # upserted last, at seq 3
    compact_tombstones(spark, cfg.table("orders"))
    retained = read_table(spark, tombstones).collect()
    assert sorted((r["order_id"], r["_src_seq"]) for r in retained) == [(k, 3) for k in range(0, 40, 2)]


def test_a_new_checkpoint_is_never_skipped_by_the_old_app_id(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    """Batch ids restart at 0 with a new checkpoint: its writes must apply, not look like replays."""
    import shutil

    topic = topic_factory(partitions=2)
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "newckpt", {"orders": orders_table(topic)})
    log = produce(connection, topic, [upsert(k, 1, "a") for k in range(10)])
    run_available_now(spark, cfg)
    shutil.rmtree(cfg.checkpoint)
    log += produce(connection, topic, [upsert(k, 2, "b") for k in range(5)] + [delete(9, 2)])
    run_available_now(spark, cfg)  # replays from earliest under a new checkpoint id: batch 0 again
    assert_matches_model(spark, cfg, log)
    assert {k: r["status"] for k, r in rows_by_key(spark, cfg).items()} == {
        **{k: "b" for k in range(5)},
        **{k: "a" for k in range(5, 9)},
    }
