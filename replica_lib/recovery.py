"""Where a replica starts, and whether it may: checkpoint ownership, checkpoint loss, data loss.

* A checkpoint records which replica and topics it belongs to (``_replica.json``); another replica's checkpoint
  is refused, since its offsets would silently skip or repeat this replica's log.
* A checkpoint that has finished a batch trusts the tables to hold everything before its offsets. So it also
  records the Delta id of each table it writes; a table that is missing, was created again, or is another table
  (a new location, another replica's) is refused before anything is created: going on would leave out every
  change before the checkpoint's offsets. Ids outlive OPTIMIZE and maintenance, and a table that no batch has
  written to yet (all its records quarantined, or none for it) keeps its id, so neither is refused.
* A table's keys cannot change under it: the retained deletes' columns say which keys it was built with.
* With no checkpoint (lost or deleted) but tables that already hold replica commits, the replica resumes from the
  offsets recorded in its own Delta commits (the smallest over its tables) instead of replaying from the start.
* If the log no longer holds records the replica has not applied (retention deleted them unread), it refuses to
  start, names what is missing and says how to rebuild, instead of skipping them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from replica_lib.config import ReplicaConfig, TableConfig, Target
from replica_lib.errors import (
    CheckpointError,
    ConfigError,
    DataLossError,
    KeyAcrossPartitionsError,
    PartitionsChangedError,
    ReplicaError,
    jvm_causes,
    jvm_condition,
)
from replica_lib.progress import (
    Offsets,
    applied_offsets,
    batch_ids,
    last_committed_offsets,
    last_writer,
    offsets_json,
    path_exists,
    read_text,
    write_text,
)
from replica_lib.target import (
    PROVENANCE_COLUMNS,
    applied_target,
    changes_target,
    read_table,
    table_exists,
    table_id,
    tombstone_target,
)

logger = logging.getLogger(__name__)

OWNER_FILE = "_replica.json"
LOCK_FILE = "_replica.lock"
QUARANTINE_LABEL = "_quarantine"  # the quarantine table's entry in the owner file's table_ids
_held_locks: dict[str, int] = {}  # checkpoint -> file descriptor, held until this process exits


def lock_checkpoint(cfg: ReplicaConfig) -> None:
    """One running instance per replica: an exclusive lock on a local checkpoint folder.

    The kernel drops the lock when the process dies (even by SIGKILL), so a killed replica never leaves a stale
    lock. Checkpoints on other storage (HDFS, object stores) rely on Spark's own detection of a second writer.
    """
    parsed = urlparse(cfg.checkpoint)
    if parsed.scheme not in ("", "file") or cfg.checkpoint in _held_locks:
        return
    folder = parsed.path if parsed.scheme else cfg.checkpoint
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointError(
            f"replica {cfg.name} is already running on checkpoint {cfg.checkpoint} ({holder}): run one instance "
            "per replica; stop the other one first"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
    _held_locks[cfg.checkpoint] = fd


def replica_running(cfg: ReplicaConfig) -> bool | None:
    """Whether the replica (or a swap into it) runs now, by its checkpoint lock; None where that cannot be told
    (a checkpoint on other storage than a local disk)."""
    if not checkpoint_is_local(cfg):
        return None
    if cfg.checkpoint in _held_locks:
        return True  # this very process runs it
    parsed = urlparse(cfg.checkpoint)
    path = os.path.join(parsed.path if parsed.scheme else cfg.checkpoint, LOCK_FILE)
    if not os.path.exists(path):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock this probe took
    return False


def checkpoint_is_local(cfg: ReplicaConfig) -> bool:
    """Whether the checkpoint is on a local disk, where :func:`lock_checkpoint` can tell a running replica."""
    return urlparse(cfg.checkpoint).scheme in ("", "file")


def wait_until_stopped(cfg: ReplicaConfig, timeout_s: float, waiting: Callable[[], None]) -> float:
    """Take the replica's checkpoint lock, waiting up to ``timeout_s`` for a running replica to stop.

    Calls ``waiting`` once if the replica is running; returns when the lock was taken (``time.monotonic()``).
    Raises :class:`CheckpointError` if the replica is still running after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        try:
            lock_checkpoint(cfg)
            return time.monotonic()
        except CheckpointError as exc:
            if time.monotonic() >= deadline:
                raise CheckpointError(f"{exc} (waited {timeout_s:.0f} s)") from None
            if not told:
                waiting()
                told = True
        time.sleep(0.5)  # polling another process's lock: the kernel has no way to wait for it with a timeout


def release_checkpoint(cfg: ReplicaConfig) -> None:
    """Let go of the checkpoint lock this process holds (if any)."""
    fd = _held_locks.pop(cfg.checkpoint, None)
    if fd is not None:
        os.close(fd)


def _owner_path(cfg: ReplicaConfig) -> str:
    return f"{cfg.checkpoint.rstrip('/')}/{OWNER_FILE}"


def _read_owner(spark: SparkSession, cfg: ReplicaConfig) -> dict[str, Any] | None:
    """The checkpoint's owner file, or None if there is none yet.

    A file cut short (the replica killed while writing it) counts as none while the checkpoint has applied
    nothing: it is written again before the first batch.
    """
    path = _owner_path(cfg)
    if not path_exists(spark, path):
        return None
    try:
        owner = json.loads(read_text(spark, path))
        if not isinstance(owner, dict):
            raise ValueError(f"not a JSON object: {owner!r}")
    except ValueError as exc:
        if last_committed_offsets(spark, cfg.checkpoint) is None:
            return None
        raise CheckpointError(f"replica {cfg.name}: {path} is damaged ({exc}); {_rebuild_fix(cfg)}") from exc
    return owner


def _rebuild_fix(cfg: ReplicaConfig) -> str:
    return (
        f"to rebuild the replica from the log, stop it and remove its checkpoint folder {cfg.checkpoint}, then "
        f"start it again ({cfg.source_file})"
    )


def check_checkpoint(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Before any table is created: the checkpoint is this replica's, and its tables are the ones it wrote.

    Raises :class:`CheckpointError` (or :class:`ConfigError` for changed keys) with the reason and the fix.
    """
    owner = _read_owner(spark, cfg)
    if owner is not None:
        if owner.get("replica") != cfg.name or owner.get("topics") != list(cfg.topics):
            raise CheckpointError(
                f"checkpoint {cfg.checkpoint} belongs to replica {owner.get('replica')!r} reading "
                f"{', '.join(owner.get('topics', []))}, not to {cfg.name!r} reading {', '.join(cfg.topics)} "
                f"({cfg.source_file}): give each replica its own replica.checkpoint folder"
            )
    elif batch_ids(spark, f"{cfg.checkpoint.rstrip('/')}/offsets") and not path_exists(spark, _owner_path(cfg)):
        raise CheckpointError(
            f"checkpoint {cfg.checkpoint} has progress but no {OWNER_FILE}: it was not made by a replica; "
            "use an empty folder for replica.checkpoint"
        )
    _check_writers(spark, cfg)
    _check_keys(spark, cfg)
    _check_pending(spark, cfg)
    committed = last_committed_offsets(spark, cfg.checkpoint)
    if owner is None or committed is None:
        return  # nothing applied yet (or a new checkpoint): any table will do, missing ones are created
    _check_sequences(cfg, owner.get("sequence_by", {}))
    recorded: dict[str, str] = owner.get("table_ids", {})
    applied = json.dumps(offsets_json(committed))
    for table in cfg.tables:
        problem = _table_problem(spark, cfg, table, owner, recorded)
        if problem is not None:
            raise CheckpointError(
                f"replica {cfg.name}: checkpoint {cfg.checkpoint} has applied the log up to {applied}, but {problem}: "
                f"going on would leave out every change before those offsets; {_rebuild_fix(cfg)}"
            )


def _table_problem(
    spark: SparkSession, cfg: ReplicaConfig, table: TableConfig, owner: dict[str, Any], recorded: dict[str, str]
) -> str | None:
    """Why ``table`` (or its retained deletes) is not what the checkpoint wrote to, or None if it is."""
    if table.name not in owner.get("tables", []):
        return f"table {table.name} is new to it (it wrote {', '.join(owner.get('tables', []))})"
    for label, target in _targets(table):
        if label == f"{table.name}__changes" and label not in recorded:
            continue  # the table became merge-on-read: its change log is new, and created empty
        what = {table.name: f"table {table.name}", f"{table.name}__changes": f"the change log of {table.name}"}.get(
            label, f"the retained deletes of {table.name}"
        )
        current = table_id(spark, target)
        if current is None:
            return f"{what} ({target.describe()}) does not exist"
        if label in recorded and recorded[label] != current:
            return f"{what} ({target.describe()}) is not the table it wrote to (created again, or another table)"
        if label not in recorded and label == table.name:  # a checkpoint from before table ids were recorded
            last = applied_offsets(spark, target)
            if last is not None and last.replica != cfg.name:
                return f"{what} ({target.describe()}) holds the commits of replica {last.replica}"
            if last is None and not _empty(spark, target):
                return f"{what} ({target.describe()}) holds rows that no commit of replica {cfg.name} wrote"
    return None


def _targets(table: TableConfig) -> list[tuple[str, Target]]:
    """A table's Delta tables, labelled as in the owner file's ``table_ids``."""
    targets = [(table.name, table.target), (f"{table.name}__tombstones", tombstone_target(table))]
    if table.merge_on_read:
        targets.append((f"{table.name}__changes", changes_target(table)))
    return targets


def _empty(spark: SparkSession, target: Target) -> bool:
    return read_table(spark, target).limit(1).count() == 0


def _check_writers(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Refuse a table that another replica writes: two replicas in one table overwrite each other's rows (each
    applies its own log, with its own offsets and versions), whichever checkpoint each has."""
    for table in cfg.tables:
        for target in dict.fromkeys((table.target, applied_target(table))):
            if not table_exists(spark, target):
                continue
            writer = last_writer(spark, target)
            if writer is not None and writer != cfg.name:
                raise CheckpointError(
                    f"replica {cfg.name}: {target.describe()} (tables.{table.name}.target in {cfg.source_file}) is "
                    f"written by replica {writer!r}, and two replicas cannot share a table: give {cfg.name} a "
                    f'target of its own, or if it is {writer!r} renamed, restore replica.name = "{writer}"'
                )


def _check_keys(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Refuse a change of a table's keys: its retained deletes (the key columns, then provenance) keep the old."""
    for table in cfg.tables:
        target = tombstone_target(table)
        if not table_exists(spark, target):
            continue
        columns = read_table(spark, target).schema.fieldNames()
        built = columns[: columns.index(PROVENANCE_COLUMNS[0])] if PROVENANCE_COLUMNS[0] in columns else columns
        if built != list(table.keys):
            raise ConfigError(
                cfg.source_file,
                f"tables.{table.name}.keys",
                f"keys changed from {built} to {list(table.keys)} since the replica built {table.target.describe()}",
                f"restore keys = {json.dumps(built)}; or rebuild the replica with the new keys (they regroup every "
                f"row): new table locations and a new, empty replica.checkpoint folder",
            )


def _check_sequences(cfg: ReplicaConfig, recorded: dict[str, str | None]) -> None:
    """Refuse a change of a table's ``sequence_by`` other than from none to one (recorded: what the checkpoint's
    batches ordered each table by).

    The table's rows keep the versions the old sequence gave them, and a change must be newer than its key's row to
    be applied: the log position (no sequence) ranks below any sequence, and another column's values have another
    scale, so the changes that follow would be left out as older, silently. From none to a sequence is safe: any
    sequence ranks above none.
    """
    for table in cfg.tables:
        if table.name not in recorded:
            continue  # a new table, or a checkpoint that did not record them yet
        old, new = recorded[table.name], table.sequence_by
        if old is None or old == new:
            continue
        by = "the log position" if new is None else f"{new}"
        raise ConfigError(
            cfg.source_file,
            f"tables.{table.name}.sequence_by",
            f"changed from {old!r} to {new!r} since the replica built {table.target.describe()}: its rows carry "
            f"versions of {old}, which {by} cannot be compared with, so later changes would be left out as older",
            f"restore sequence_by = {json.dumps(old)}; or rebuild the replica with the new one (its new checkpoint "
            f"orders every change by it): ./replica rebuild {cfg.source_file} --into <folder> --swap",
        )


def _check_pending(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Refuse a copy-on-write table whose change log (from when it was merge-on-read) still holds changes."""
    for table in cfg.tables:
        log = changes_target(table)
        if table.merge_on_read or not table_exists(spark, log) or _empty(spark, log):
            continue
        raise ConfigError(
            cfg.source_file,
            f"tables.{table.name}.layout",
            f"{log.describe()} holds changes not yet folded into {table.target.describe()}: as copy-on-write the "
            "table would go on without them",
            f'set layout = "merge-on-read" again and fold them (./spark-submit.sh jobs/maintain.py '
            f"{cfg.source_file}), then switch",
        )


def claim_checkpoint(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Label the checkpoint as this replica's and record its tables' Delta ids (once they exist).

    While the checkpoint has applied nothing the ids are recorded afresh; once it has, they stay those of the
    tables it wrote to, and :func:`check_checkpoint` holds the tables to them.
    """
    owner = _read_owner(spark, cfg)
    progress = owner is not None and last_committed_offsets(spark, cfg.checkpoint) is not None
    recorded: dict[str, str] = dict(owner.get("table_ids", {})) if owner is not None and progress else {}
    labels = [*(pair for table in cfg.tables for pair in _targets(table)), (QUARANTINE_LABEL, cfg.quarantine)]
    for label, target in labels:
        if label in recorded and label != QUARANTINE_LABEL:
            continue
        current = str(table_id(spark, target))
        if label in recorded and recorded[label] != current:
            logger.warning(
                "replica %s: quarantine table %s was created again: it holds the records quarantined from now on",
                cfg.name,
                cfg.quarantine.describe(),
            )
        recorded[label] = current
    tables = (owner or {}).get("tables") if progress else None
    ours = {
        "replica": cfg.name,
        "topics": list(cfg.topics),
        "tables": tables or sorted(t.name for t in cfg.tables),
        "table_ids": recorded,
        "sequence_by": {t.name: t.sequence_by for t in cfg.tables},
    }
    if ours != owner:  # written only when it changes: a kill while writing it can cut it short
        write_text(spark, _owner_path(cfg), json.dumps(ours) + "\n")


def _table_offsets(spark: SparkSession, cfg: ReplicaConfig) -> Offsets | None:
    """Per topic and partition, the smallest offset that every table of the topic has applied."""
    resumed: Offsets = {}
    for topic in cfg.topics:
        per_table = []
        for table in (t for t in cfg.tables if t.topic == topic):
            target = applied_target(table)
            applied = applied_offsets(spark, target) if table_exists(spark, target) else None
            if applied is None or applied.replica != cfg.name or topic not in applied.offsets:
                return None  # some table has nothing to resume from: replay from the configured start
            per_table.append(applied.offsets[topic])
        partitions = set().union(*per_table)
        resumed[topic] = {p: min(offsets.get(p, 0) for offsets in per_table) for p in sorted(partitions)}
    return resumed


def starting_offsets(spark: SparkSession, cfg: ReplicaConfig) -> str | None:
    """Spark ``startingOffsets`` JSON when resuming a lost checkpoint from the tables; None otherwise."""
    if batch_ids(spark, f"{cfg.checkpoint.rstrip('/')}/offsets"):
        return None  # the checkpoint knows where to go on
    resumed = _table_offsets(spark, cfg)
    if resumed is None:
        return None
    logger.warning(
        "replica %s: checkpoint %s is new, but its tables have applied the log up to %s: resuming from there "
        "(records below those offsets are not read again)",
        cfg.name,
        cfg.checkpoint,
        json.dumps(resumed),
    )
    return json.dumps(offsets_json(resumed))


def check_log_still_holds(applied: Offsets, log_start: Offsets, cfg: ReplicaConfig) -> None:
    """Raise :class:`DataLossError` if any partition's log now starts after what the replica has applied."""
    missing = [
        (topic, partition, offset, log_start[topic][partition])
        for topic, parts in sorted(applied.items())
        for partition, offset in sorted(parts.items())
        if log_start.get(topic, {}).get(partition, 0) > offset
    ]
    if missing:
        gaps = "; ".join(f"{t}[{p}] offsets {a}..{s - 1}" for t, p, a, s in missing)
        raise DataLossError(
            f"replica {cfg.name}: the log no longer holds records it has not applied ({gaps}): retention deleted "
            f"them unread. The replica cannot be made exact by going on. Rebuild it: stop it, delete its tables and "
            f"its checkpoint ({cfg.checkpoint}) and run it again to replay the log from the start; the topic must "
            f"be compacted (cleanup.policy=compact) for the replay to hold every key"
        )


def check_partitions(cfg: ReplicaConfig, before: Offsets, now: Mapping[str, Iterable[int]], seen: str) -> None:
    """Raise :class:`PartitionsChangedError` if a topic has partitions ``now`` that it had not ``before`` (offsets
    the replica knew, some past a record), and a table of it is ordered by log position.

    Kafka picks a key's partition by the partition count: once it grows, a key's new changes may land in another
    partition than its old ones, and a version without a sequence, ``(partition, offset)``, then ranks them by
    partition number instead of by time: a key's later change can lose to its earlier one. A partition added
    before any record was written moves no key.
    """
    for topic, partitions in sorted(now.items()):
        known = before.get(topic, {})
        added = sorted(set(partitions) - set(known))
        if not added or not any(offset > 0 for offset in known.values()):
            continue
        tables = [t.name for t in cfg.tables if t.topic == topic and t.sequence_by is None]
        if not tables:
            continue
        raise PartitionsChangedError(
            f"replica {cfg.name}: topic {topic} has gained partitions {', '.join(map(str, added))} (from "
            f"{len(known)} to {len(known) + len(added)}, {seen}): Kafka now sends some keys to another partition "
            f"than their earlier changes, and {', '.join(tables)} {'is' if len(tables) == 1 else 'are'} ordered by "
            f"log position (no sequence_by in {cfg.source_file}), which orders a key's changes within one partition "
            "only; going on could apply them out of order, so the replica stopped. Set sequence_by to a version the "
            "primary writes with every change, then rebuild beside the live replica and swap it in "
            f"(./replica rebuild {cfg.source_file} --into <folder> --swap)"
        )


#: Spark's error condition for ``raise_error``, which only :meth:`replica_lib.ordering.LogOrder.refusal` uses.
_REFUSED = "USER_RAISED_EXCEPTION"


def key_across_partitions(exc: BaseException, cfg: ReplicaConfig) -> KeyAcrossPartitionsError | None:
    """The replica's error for a Spark job that :class:`~replica_lib.ordering.LogOrder` failed, or None.

    Told by Spark's error condition; the message's parameter, built by the job, names the key and partitions.
    """
    from pyspark import SparkContext

    for cause in jvm_causes(exc):
        if jvm_condition(SparkContext._gateway, cause) == _REFUSED:
            what = cause.getMessageParameters().get("errorMessage")
            return KeyAcrossPartitionsError(
                f"replica {cfg.name}: {what}: Kafka orders a key's changes within one partition, and the table is "
                f"ordered by log position (no sequence_by in {cfg.source_file}), so which of them is later cannot "
                "be told (the topic gained partitions, or producers partition the key differently); the replica "
                "stopped before applying them. Set sequence_by to a version the primary writes with every change, "
                f"then rebuild beside the live replica and swap it in (./replica rebuild {cfg.source_file} --into "
                "<folder> --swap)"
            )
    return None


@contextlib.contextmanager
def log_order_kept(cfg: ReplicaConfig) -> Iterator[None]:
    """Raise :func:`key_across_partitions`'s error for a failure of the block that it tells, else the failure."""
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    try:
        yield
    except (Py4JJavaError, PySparkException) as exc:
        refused = key_across_partitions(exc, cfg)
        if refused is None:
            raise
        raise refused from exc


def applied_so_far(spark: SparkSession, cfg: ReplicaConfig) -> Offsets | None:
    """How far the replica has applied the log: its checkpoint's last finished batch, else its tables."""
    return last_committed_offsets(spark, cfg.checkpoint) or _table_offsets(spark, cfg)


#: Spark's error condition (its Kafka source's, with failOnDataLoss) for records the log no longer holds.
_DATA_LOSS = "KAFKA_DATA_LOSS"
_OFFSET_OUT_OF_RANGE = "org.apache.kafka.clients.consumer.OffsetOutOfRangeException"
#: Spark's error conditions for two queries writing one checkpoint.
_SHARED_CHECKPOINT = frozenset({"CONCURRENT_STREAM_LOG_UPDATE", "CONCURRENT_QUERY", "_LEGACY_ERROR_TEMP_2207"})


def explain(exc: BaseException, cfg: ReplicaConfig, batch_failure: BaseException | None = None) -> ReplicaError | None:
    """A clear error for a failure of the query that users meet in operation, or None.

    Told by Spark's error conditions and the Kafka client's exception class. A failure inside a batch reaches the
    query as the text of a Python traceback only, so ``batch_failure`` is what the batch raised, as it raised it.
    """
    from py4j.java_gateway import is_instance_of
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    causes = [cause for failure in (exc, batch_failure) if failure is not None for cause in jvm_causes(failure)]
    for cause in causes:
        condition = jvm_condition(gateway, cause) or ""
        if condition.split(".")[0] == _DATA_LOSS or is_instance_of(gateway, cause, _OFFSET_OUT_OF_RANGE):
            return DataLossError(
                f"replica {cfg.name}: Kafka no longer holds offsets this replica still needs (retention or a topic "
                f"reset deleted them unread), so it stopped instead of skipping them. Rebuild it: stop it, delete "
                f"its tables and its checkpoint ({cfg.checkpoint}) and run it again to replay the log from the start"
            )
        if condition in _SHARED_CHECKPOINT:
            return CheckpointError(
                f"replica {cfg.name}: another instance is running on checkpoint {cfg.checkpoint}; this one stopped. "
                "Run one instance per replica"
            )
    return None
