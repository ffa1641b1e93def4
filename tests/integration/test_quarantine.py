"""Ordered quarantine: a quarantined record holds its key's later records; replay after a fix and drop release
it, exactly once. Both layouts, checked against the reference model at each step."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from chispa import assert_df_equality
from confluent_kafka import Producer
from pyspark.sql import DataFrame, SparkSession

from jobs import quarantine as quarantine_job
from replica_dev.model import LoggedChange, fold
from replica_lib.config import ReplicaConfig
from replica_lib.errors import CheckpointError, RebuildError
from replica_lib.producer import Change, Position
from replica_lib.quarantine import DROPPED, reasons, resolve, select, unresolved
from replica_lib.rebuild import rebuild
from replica_lib.recovery import LOCK_FILE, release_checkpoint
from replica_lib.replay import replay
from replica_lib.swap import swap
from replica_lib.target import delta_table, replica_targets
from tests.integration.support import orders_table, produce, replica_config, replica_df, run_available_now

pytestmark = pytest.mark.integration

SCHEMA = "order_id BIGINT, customer STRING, amount DOUBLE, status STRING, updated_ms BIGINT, qty INT"
WIDER = SCHEMA.replace("qty INT", "qty BIGINT")
TOO_BIG = 5_000_000_000  # for a strict table's INT column: quarantined until the config widens it
#: Holds an exclusive lock on the file argv[1] until its stdin closes, as a running replica holds its checkpoint's.
HOLD_LOCK = (
    "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
    "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('locked', flush=True); sys.stdin.read()"
)


def change(order_id: int, seq: int, qty: int = 1) -> Change:
    row = {"order_id": order_id, "customer": f"c{order_id}", "amount": 2.0, "status": f"s{seq}", "updated_ms": seq}
    return Change(key={"order_id": order_id}, op="upsert", data=row | {"qty": qty}, seq=seq)


def gone(order_id: int, seq: int) -> Change:
    return Change(key={"order_id": order_id}, op="delete", seq=seq)


def garbage(connection: dict[str, str], topic: str, order_id: int) -> Position:
    """A record with a good key and a value that is not JSON, in partition 0 (where the tests' keys go)."""
    at: list[Position] = []
    producer = Producer({**connection, "enable.idempotence": True})
    producer.produce(
        topic,
        key=f'{{"order_id": {order_id}}}'.encode(),
        value=b"{not json",
        partition=0,
        on_delivery=lambda _e, m: at.append(Position(m.topic(), m.partition(), m.offset())),
    )
    producer.flush(30)
    return at[0]


def state(spark: SparkSession, cfg: ReplicaConfig, table: str) -> DataFrame:
    return replica_df(spark, cfg, table)


def assert_model(spark: SparkSession, cfg: ReplicaConfig, table: str, log: Iterable[LoggedChange]) -> None:
    spec = cfg.table(table)
    rows = fold(list(log), {table: spec.keys}, {table: True})[table]
    actual = state(spark, cfg, table)
    expected = spark.createDataFrame([tuple(r.get(c) for c in actual.columns) for r in rows.values()], actual.schema)
    assert_df_equality(actual, expected, ignore_row_order=True, ignore_nullable=True)


def test_a_quarantined_record_holds_its_key_until_replayed_or_dropped_and_a_rebuild_swapped_in_keeps_that(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topics = {"cow": topic_factory(partitions=1), "mor": topic_factory(partitions=1)}
    # Strict tables: a value too big for qty is quarantined, not a reason to widen the column (add_columns would).
    tables = {
        "cow": orders_table(topics["cow"], schema=SCHEMA, schema_evolution="strict"),
        "mor": orders_table(topics["mor"], schema=SCHEMA, layout="merge-on-read", schema_evolution="strict"),
    }
    bootstrap = connection["bootstrap.servers"]
    cfg = replica_config(tmp_path, bootstrap, "held", tables)
    log: dict[str, list[LoggedChange]] = {}
    applied: dict[str, list[LoggedChange]] = {}  # what the model says is applied at each step
    bad_at: dict[str, Position] = {}
    for table, topic in topics.items():
        first = produce(connection, topic, [change(1, 1), change(1, 2, qty=TOO_BIG), change(1, 3), gone(1, 4)], table)
        first += produce(connection, topic, [change(2, 5), change(2, 6), change(3, 7), change(4, 9)], table)
        bad_at[table] = garbage(connection, topic, 3)
        last = produce(connection, topic, [change(3, 8)], table)
        log[table] = first + last
        # Applied: key 1 up to its record too big for qty, key 3 up to the garbage, everything of keys 2 and 4.
        applied[table] = [first[0], *first[4:]]

    run_available_now(spark, cfg)
    for table in topics:
        assert_model(spark, cfg, table, applied[table])
    held_reason = "held behind an earlier quarantined record of its key (on_poison = hold_key): "
    held_reason += "replay or drop that record with ./replica quarantine"
    found = {r.reason: r.records for r in reasons(spark, cfg)}
    assert found == {
        held_reason: 6,  # keys 1 (two changes) and 3 (one), in each table
        "data does not match the table schema: qty (int)": 2,
        "value is not a JSON object: not valid JSON (NaN, Infinity, single quotes, comments and leading zeros are "
        "not JSON)": 2,
    }, found

    # Later changes of a held key are held too; other keys flow.
    for table, topic in topics.items():
        more = produce(connection, topic, [change(1, 11), change(4, 12), change(2, 13)], table)
        log[table] += more
        applied[table] += more[1:]
    run_available_now(spark, cfg)
    for table in topics:
        assert_model(spark, cfg, table, applied[table])

    # A replay refuses to run beside the replica: another process holds its checkpoint lock.
    release_checkpoint(cfg)  # this process's runs took it
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(Path(cfg.checkpoint) / LOCK_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError):
            replay(spark, cfg, wait_s=0)
    finally:
        holder.communicate("", timeout=30)

    # The fix: qty becomes BIGINT. The replay widens the column, applies key 1's records in log order and leaves
    # key 3 held behind its garbage.
    fixed = replica_config(tmp_path, bootstrap, "held", {t: {**spec, "schema": WIDER} for t, spec in tables.items()})
    done = replay(spark, fixed)
    assert (done.records, done.replayed) == (12, 8), done  # key 1's four records in each table
    for table in topics:
        applied[table] += [e for e in log[table] if e.change.key["order_id"] == 1]
        assert_model(spark, fixed, table, applied[table])
    assert {r.reason for r in done.still} == {held_reason, next(r for r in found if r.startswith("value"))}

    # Dropping the garbage alone releases nothing yet: the record it held is replayed next. Both tables' garbage
    # in one drop (each place is in its own table's topic).
    places = [f"{at.topic}/{at.partition}/{at.offset}" for at in bad_at.values()]
    records = select(unresolved(spark, fixed), list(topics), places)
    resolve(spark, fixed, records, DROPPED, "the service sent a broken record; key 3 checked by hand")
    done = replay(spark, fixed)
    assert (done.records, done.replayed, done.still) == (2, 2, ()), done
    for table in topics:
        applied[table] += [e for e in log[table] if e.change.key["order_id"] == 3]
        assert_model(spark, fixed, table, applied[table])
    assert reasons(spark, fixed) == []

    # A replay again applies nothing: no record, and no commit.
    versions = {t: delta_table(spark, fixed.table(t).target).history(1).first()["version"] for t in topics}
    assert replay(spark, fixed).records == 0
    assert versions == {t: delta_table(spark, fixed.table(t).target).history(1).first()["version"] for t in topics}

    # Released keys flow again, and the table is the model of the whole log but the dropped record.
    for table, topic in topics.items():
        log[table] += produce(connection, topic, [change(1, 20), change(3, 21), gone(2, 22)], table)
    run_available_now(spark, fixed)
    for table in topics:
        assert_model(spark, fixed, table, log[table])

    # Key 5's bad record dropped, and the record it held not replayed yet: a drop alone releases nothing.
    bad_5 = {table: garbage(connection, topic, 5) for table, topic in topics.items()}
    for table, topic in topics.items():
        log[table] += produce(connection, topic, [change(5, 25)], table)
    run_available_now(spark, fixed)
    places = [f"{at.topic}/{at.partition}/{at.offset}" for at in bad_5.values()]
    resolve(spark, fixed, select(unresolved(spark, fixed), list(topics), places), DROPPED, "broken; key 5 later")

    def but_key_5(table: str) -> list[LoggedChange]:
        return [e for e in log[table] if e.change.key["order_id"] != 5]

    for table in topics:
        assert_model(spark, fixed, table, but_key_5(table))

    # A rebuild's quarantine starts empty: it holds keys 3 and 5 behind their garbage again, below where the live
    # replica stands. Swapped in (killed once between the rebuild's drops and its replay, then run again), key 3
    # keeps the state the live replica reached (s21, not s7), key 5 stays held by its record, and the replica goes
    # on from there.
    class Crash(Exception):
        pass

    def crash_once(point: str) -> None:
        if point == "after_rebuild_drops" and not crashed:
            crashed.append(point)
            raise Crash(point)

    crashed: list[str] = []
    rebuild(spark, fixed, str(tmp_path / "rebuilt"))
    with pytest.raises(Crash):
        swap(spark, fixed, str(tmp_path / "rebuilt"), at=crash_once)
    swap(spark, fixed, str(tmp_path / "rebuilt"), at=crash_once)
    for table in topics:
        assert_model(spark, fixed, table, but_key_5(table))
    assert {r.reason: r.records for r in reasons(spark, fixed)} == {held_reason: 2}
    for table, topic in topics.items():
        log[table] += produce(connection, topic, [change(3, 30), change(1, 31)], table)
    run_available_now(spark, fixed)
    for table in topics:
        assert_model(spark, fixed, table, but_key_5(table))
    done = replay(spark, fixed)
    assert (done.records, done.replayed, done.still) == (2, 2, ()), done
    for table in topics:
        assert_model(spark, fixed, table, log[table])

    # A rebuild by the file's schema before the fix rejects key 1's record that the live replica replayed after it:
    # swapped in, that change would be lost, so the swap stops before it replaces a table.
    rebuild(spark, cfg, str(tmp_path / "unfixed"))
    with pytest.raises(RebuildError, match="rejects records that the live replica applied after a fix"):
        swap(spark, cfg, str(tmp_path / "unfixed"))
    for table in topics:
        assert_model(spark, fixed, table, log[table])


def test_a_lost_quarantine_table_is_refused_and_the_rebuild_in_place_holds_its_keys_again(
    spark: SparkSession, connection: dict[str, str], topic_factory: Any, tmp_path: Path
) -> None:
    topic = topic_factory(partitions=1)
    table = orders_table(topic, schema=SCHEMA, schema_evolution="strict")
    cfg = replica_config(tmp_path, connection["bootstrap.servers"], "lost", {"orders": table})
    log = produce(connection, topic, [change(1, 1), change(1, 2, qty=TOO_BIG), change(1, 3), change(2, 4)])
    run_available_now(spark, cfg)
    assert_model(spark, cfg, "orders", [log[0], log[3]])  # key 1 held behind its record too big for qty

    # The quarantine folder removed by hand: its two records of key 1 would be lost, and key 1 would stay at seq 1.
    assert cfg.quarantine.path is not None
    shutil.rmtree(cfg.quarantine.path)
    with pytest.raises(CheckpointError) as refused:
        run_available_now(spark, cfg)
    assert f"beside quarantine table {cfg.quarantine.describe()}, but it is gone" in str(refused.value)
    assert f"remove its checkpoint folder {cfg.checkpoint} and its tables" in str(refused.value)
    assert not Path(cfg.quarantine.path).exists()  # refused before any table was created
    # The checkpoint removed too (what other refusals say to do): the tables' commits name the quarantine table.
    release_checkpoint(cfg)
    shutil.rmtree(cfg.checkpoint)
    with pytest.raises(CheckpointError, match="its tables' newest commits were written beside quarantine table"):
        run_available_now(spark, cfg)
    assert not Path(cfg.quarantine.path).exists()

    # The fix it gives: the tables removed too, the replica started again rebuilds from the log.
    release_checkpoint(cfg)
    shutil.rmtree(cfg.checkpoint, ignore_errors=True)
    for target in replica_targets(cfg, metrics=False):
        assert target.path is not None
        shutil.rmtree(target.path, ignore_errors=True)
    log += produce(connection, topic, [change(2, 5)])
    run_available_now(spark, cfg)
    assert_model(spark, cfg, "orders", [log[0], log[4]])
    found = {r.reason: r.records for r in reasons(spark, cfg)}
    assert found == {
        "held behind an earlier quarantined record of its key (on_poison = hold_key): replay or drop that record "
        "with ./replica quarantine": 1,
        "data does not match the table schema: qty (int)": 1,
    }, found


def test_drop_needs_a_place_or_all() -> None:
    with pytest.raises(SystemExit) as exited:
        quarantine_job.main(["drop", "conf/orders_a.toml", "--reason", "x"])
    assert exited.value.code == 2
