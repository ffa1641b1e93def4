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
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_lib.config import ReplicaConfig, TableConfig, Target
from replica_lib.errors import (
    CheckpointError,
    ConfigError,
    DataLossError,
    KeyAcrossPartitionsError,
    PartitionsChangedError,
    ReplicaError,
    TopicReplacedError,
    jvm_causes,
    jvm_condition,
)
from replica_lib.progress import (
    AppliedVersion,
    Offsets,
    applied_offsets,
    batch_end_offsets,
    batch_ids,
    checkpoint_generation,
    last_committed_offsets,
    last_writer,
    newest_commit,
    offsets_json,
    path_exists,
    read_text,
    restored_since,
    write_text,
)
from replica_lib.target import (
    PROVENANCE_COLUMNS,
    applied_target,
    changes_target,
    creator,
    read_table,
    replica_targets,
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
    _check_restored(spark, cfg)
    _check_planned(spark, cfg)
    committed = last_committed_offsets(spark, cfg.checkpoint)
    by_owner: dict[str, str | None] = (owner or {}).get("sequence_by", {})
    newest = _newest_commits(spark, cfg)  # what they record travels with the tables: a new checkpoint is checked too
    by_tables = _sequences_recorded(cfg, newest)
    _check_unsequenced(spark, cfg, owner, {**by_owner, **by_tables})
    _check_sequences(cfg, {**(by_owner if committed is not None else {}), **by_tables})
    if owner is None or committed is None:  # nothing applied yet, or a new checkpoint: missing tables are created
        _check_quarantine_kept(spark, cfg, _quarantine_recorded(newest), "its tables' newest commits were written")
        return
    recorded: dict[str, str] = owner.get("table_ids", {})
    applied = json.dumps(offsets_json(committed))
    for table in cfg.tables:
        problem = _table_problem(spark, cfg, table, owner, recorded)
        if problem is not None:
            raise CheckpointError(
                f"replica {cfg.name}: checkpoint {cfg.checkpoint} has applied the log up to {applied}, but {problem}: "
                f"going on would leave out every change before those offsets; {_rebuild_fix(cfg)}"
            )
    where = f"checkpoint {cfg.checkpoint} has applied the log up to {applied}"
    _check_quarantine_kept(spark, cfg, recorded.get(QUARANTINE_LABEL), where)


def _newest_commits(spark: SparkSession, cfg: ReplicaConfig) -> dict[str, AppliedVersion]:
    """Per table, what its newest commit of this replica records (tables without one left out)."""
    found: dict[str, AppliedVersion] = {}
    for table in cfg.tables:
        target = applied_target(table)
        newest = newest_commit(spark, target, cfg.name) if table_exists(spark, target) else None
        if newest is not None:
            found[table.name] = newest.applied
    return found


def _quarantine_recorded(newest: dict[str, AppliedVersion]) -> str | None:
    """The quarantine table's id that a table's newest commit records, where one does (older commits, a rebuild's
    and a swap's do not)."""
    return next((applied.quarantine_id for applied in newest.values() if applied.quarantine_id is not None), None)


def _check_quarantine_kept(spark: SparkSession, cfg: ReplicaConfig, recorded: str | None, where: str) -> None:
    """Refuse a quarantine table that is gone, or another table now, once batches were applied beside it (the
    checkpoint's owner file says which, and the tables' commits do too: a removed checkpoint changes nothing).

    Its unresolved records hold their keys: the later changes of such a key wait in it too. Lost with it, neither
    would ever be replayed, and the key would keep, with no sign of it, its state from before them.
    """
    if recorded is None or recorded == "None":
        return  # recorded by a replica from before quarantine ids were kept, or before the table was made
    current = table_id(spark, cfg.quarantine)
    if current == recorded:
        return
    what = (
        "is gone"
        if current is None
        else "is another table than the one the replica wrote (created again, or replica.quarantine now names another)"
    )
    raise CheckpointError(
        f"replica {cfg.name}: {where} beside quarantine table {cfg.quarantine.describe()}, but it {what}: the "
        "records it held, and the later changes of their keys held behind "
        f"them, would never be replayed, and those keys would keep their older state; restore it if you can, or "
        f"rebuild the replica from the log where it is: stop it, remove its checkpoint folder {cfg.checkpoint} and "
        f"its tables ({', '.join(t.describe() for t in replica_targets(cfg, metrics=False))}), and start it again "
        "(a rebuild beside it and a swap would not do: a swap keeps the live quarantine)"
    )


def _check_restored(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Refuse a table that was restored to an older version after the replica's last batch (Delta's RESTORE).

    Its rows are then an older state than its checkpoint has applied (the changes between would never come again),
    and than its retained deletes, which are restored apart or not at all: only a rebuild makes them agree.
    """
    for table in cfg.tables:
        # The table and the one its batches record their offsets in (their histories are read at the start anyway);
        # the retained deletes alone restored would not show here.
        for target in dict.fromkeys((table.target, applied_target(table))):
            if not table_exists(spark, target):
                continue
            restored = restored_since(spark, target)
            if restored is None:
                continue
            version, to = restored
            raise CheckpointError(
                f"replica {cfg.name}: {target.describe()} was restored (RESTORE to version {to}, at version "
                f"{version}) after the replica's last batch: its rows no longer agree with what the replica applied "
                f"from the log (nor with the table's retained deletes), and going on would leave out the changes in "
                f"between; rebuild it beside the live one and swap it in: ./replica rebuild {cfg.source_file} "
                f"--into <folder> --swap"
            )


def _check_planned(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """Refuse a checkpoint that no longer holds, as planned, the last batch its tables applied.

    Spark runs a batch over the offsets its offset log planned for it, and the tables skip a batch id of this
    checkpoint that they applied already (their idempotent writes). A checkpoint whose last offset files were
    removed (a usual fix for a damaged one) or that was restored from an older copy plans that batch again, over other
    offsets: the tables would skip it as done, and the records between the two ends would never be applied.
    """
    checkpoint = cfg.checkpoint.rstrip("/")
    if not path_exists(spark, f"{checkpoint}/metadata"):
        return  # a new checkpoint: nothing planned yet
    generation = checkpoint_generation(spark, checkpoint)
    planned = batch_ids(spark, f"{checkpoint}/offsets")
    for table in cfg.tables:
        target = applied_target(table)
        newest = newest_commit(spark, target, cfg.name) if table_exists(spark, target) else None
        applied = None if newest is None else newest.applied
        if applied is None or applied.generation != generation:
            continue  # applied under another checkpoint: it resumes from the table's offsets (starting_offsets)
        if planned and applied.batch_id < planned[0]:
            continue  # older than the offset log Spark keeps
        if applied.batch_id in planned:
            again = batch_end_offsets(spark, checkpoint, applied.batch_id)
            if again == applied.offsets:
                continue
            now = f"plans batch {applied.batch_id} up to {json.dumps(offsets_json(again))}"
        else:
            now = f"has no batch {applied.batch_id} (its offset log ends at {planned[-1] if planned else 'none'})"
        raise CheckpointError(
            f"replica {cfg.name}: {target.describe()} applied batch {applied.batch_id} of checkpoint {cfg.checkpoint} "
            f"up to {json.dumps(offsets_json(applied.offsets))}, but the checkpoint now {now}: it was rolled back "
            f"(restored from an older copy, or its last files removed), and the batches it plans again would be "
            f"skipped as applied, leaving out their records; stop the replica and remove the checkpoint folder "
            f"{cfg.checkpoint}, then start it again ({cfg.source_file}): it resumes from the offsets its tables "
            "recorded"
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
    applies its own log, with its own offsets and versions), whichever checkpoint each has. A table with no commit
    yet belongs to the replica that created it: two replicas whose first batches both found it empty would both
    append their rows."""
    for table in cfg.tables:
        targets = [t for t in dict.fromkeys((applied_target(table), table.target)) if table_exists(spark, t)]
        # The batches' commits first; the creator (one more read) only where no target has one.
        written = ((t, last_writer(spark, t), "is written") for t in targets)
        created = ((t, creator(spark, t), "was created (and not written yet)") for t in targets)
        for target, writer, how in itertools.chain(written, created):
            if writer is None:
                continue
            if writer != cfg.name:
                raise CheckpointError(
                    f"replica {cfg.name}: {target.describe()} (tables.{table.name}.target in {cfg.source_file}) {how} "
                    f"by replica {writer!r}, and two replicas cannot share a table: give {cfg.name} a "
                    f'target of its own, or if it is {writer!r} renamed, restore replica.name = "{writer}"'
                )
            break


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


def _sequences_recorded(cfg: ReplicaConfig, newest: dict[str, AppliedVersion]) -> dict[str, str | None]:
    """What each table's newest commit of this replica says it was ordered by, where one says (older commits do
    not; the checkpoint's owner file then may)."""
    return {
        table.name: newest[table.name].sequence_by[table.name]
        for table in cfg.tables
        if table.name in newest and table.name in newest[table.name].sequence_by
    }


def _check_sequences(cfg: ReplicaConfig, recorded: dict[str, str | None]) -> None:
    """Refuse a change of a table's ``sequence_by`` other than from none to one (recorded: what the batches that
    built each table ordered it by, from its commits, else from the checkpoint's owner file).

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


def _check_unsequenced(
    spark: SparkSession, cfg: ReplicaConfig, owner: dict[str, Any] | None, recorded: dict[str, str | None]
) -> None:
    """Refuse a table ordered by log position whose rows carry the seq of their records.

    Replicas before this check read the envelope's ``seq`` even without ``sequence_by``, and kept it as each row's
    version; a table ordered by log position gives its changes none, which ranks below any seq, so every later
    change of such a row would be left out as older. Only ``sequence_by = "seq"`` (what ordered those rows) or a
    rebuild goes on exactly. Also where the table had no sequence and is given a column now. Once per checkpoint
    and table (the owner file's ``log_order_checked``): what a replica writes after it passed carries no such seq.
    """
    checked = set((owner or {}).get("log_order_checked", []))
    for table in cfg.tables:
        before = recorded.get(table.name)  # None: no sequence then, or not known
        if table.name in checked or before is not None or table.sequence_by == "seq":
            continue  # a change of a sequence is _check_sequences'
        if table.sequence_by is not None and table.name not in recorded:
            continue  # a sequence now, and none known before: nothing to compare its rows' versions with
        for _, target in _targets(table):  # the rows, the retained deletes, the pending changes
            if not table_exists(spark, target):
                continue
            if read_table(spark, target).where(F.col("_src_seq").isNotNull()).limit(1).count() == 0:
                continue
            now = (
                "is ordered by log position (no sequence_by)"
                if table.sequence_by is None
                else (f"had no sequence_by and is now ordered by {table.sequence_by}")
            )
            raise ConfigError(
                cfg.source_file,
                f"tables.{table.name}.sequence_by",
                f"table {table.name} {now}, but {target.describe()} holds rows ordered by their records' seq (as "
                "replicas ordered such a table before they read the log position alone): later changes would be "
                "compared with those seqs and left out as older",
                f'set sequence_by = "seq" to go on ordering it by its records\' seq; or rebuild the replica: '
                f"./replica rebuild {cfg.source_file} --into <folder> --swap",
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


def claim_checkpoint(spark: SparkSession, cfg: ReplicaConfig) -> str:
    """Label the checkpoint as this replica's and record its tables' Delta ids (once they exist); returns the
    quarantine table's, which the batches' commits record too.

    While the checkpoint has applied nothing the ids are recorded afresh; once it has, they stay those of the
    tables it wrote to, and :func:`check_checkpoint` holds the tables to them.
    """
    owner = _read_owner(spark, cfg)
    progress = owner is not None and last_committed_offsets(spark, cfg.checkpoint) is not None
    recorded: dict[str, str] = dict(owner.get("table_ids", {})) if owner is not None and progress else {}
    labels = [*(pair for table in cfg.tables for pair in _targets(table)), (QUARANTINE_LABEL, cfg.quarantine)]
    for label, target in labels:
        if label not in recorded:  # a recorded one is held to by check_checkpoint
            recorded[label] = str(table_id(spark, target))
    tables = (owner or {}).get("tables") if progress else None
    ours = {
        "replica": cfg.name,
        "topics": list(cfg.topics),
        "tables": tables or sorted(t.name for t in cfg.tables),
        "table_ids": recorded,
        "sequence_by": {t.name: t.sequence_by for t in cfg.tables},
        "log_order_checked": sorted(t.name for t in cfg.tables),  # by _check_unsequenced, before this claim
    }
    if ours != owner:  # written only when it changes: a kill while writing it can cut it short
        write_text(spark, _owner_path(cfg), json.dumps(ours) + "\n")
    return recorded[QUARANTINE_LABEL]


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
        _check_replay_from_the_start(spark, cfg)
        return None
    logger.warning(
        "replica %s: checkpoint %s is new, but its tables have applied the log up to %s: resuming from there "
        "(records below those offsets are not read again)",
        cfg.name,
        cfg.checkpoint,
        json.dumps(resumed),
    )
    return json.dumps(offsets_json(resumed))


def check_topics_kept(spark: SparkSession, cfg: ReplicaConfig, ids: Mapping[str, str]) -> None:
    """Refuse a topic that was deleted and created again under its name since a table recorded offsets of it.

    The new topic's offsets start over: the offsets the checkpoint and the tables hold name other records in it, so
    going on would skip the new topic's first records (or, once it is past them, read on as if nothing happened).
    ``ids``: each topic's id now. Tables whose commits carry no topic ids (written before they were recorded) are
    not checked.
    """
    for table in cfg.tables:
        target = applied_target(table)
        if table.topic not in ids or not table_exists(spark, target):
            continue
        newest = newest_commit(spark, target, cfg.name)
        if newest is None:
            continue
        applied = newest.applied
        then = applied.topic_ids.get(table.topic)
        if then is None or then == ids[table.topic]:
            continue
        raise TopicReplacedError(
            f"replica {cfg.name}: topic {table.topic} is not the topic table {table.name} applied the log of (its id "
            f"was {then}, it is {ids[table.topic]} now): it was deleted and created again, and its offsets started "
            f"over, so the offsets the replica applied up to "
            f"({json.dumps(offsets_json({table.topic: applied.offsets.get(table.topic, {})}))}) name other records "
            f"now; build the replica again from the new topic: stop it, give its tables new locations (or remove "
            f"them) and remove its checkpoint folder {cfg.checkpoint}, then start it ({cfg.source_file})"
        )


def _check_replay_from_the_start(spark: SparkSession, cfg: ReplicaConfig) -> None:
    """A new checkpoint whose tables hold this replica's commits, but not one for every table (one of a topic's
    tables that took no change yet, a table new to the config): there is no point to resume from that covers them
    all, so the replica reads the log from its configured start. From the earliest offsets that is exact (each
    change already applied meets its own version in the table and is not applied again); from a later start it
    would leave out every change before it, silently: refused."""
    holding = []
    for table in cfg.tables:
        target = applied_target(table)
        applied = applied_offsets(spark, target) if table_exists(spark, target) else None
        if applied is not None and applied.replica == cfg.name:
            holding.append(table.name)
    if not holding:
        return  # a new replica: its configured start is where it begins
    if cfg.source.starting_offsets.strip().lower() == "earliest":
        logger.warning(
            "replica %s: checkpoint %s is new, and not every table has applied the log to a known point (%s hold "
            "commits of this replica): reading the log from its earliest offsets, changes already applied are not "
            "applied again",
            cfg.name,
            cfg.checkpoint,
            ", ".join(holding),
        )
        return
    raise ConfigError(
        cfg.source_file,
        "source.starting_offsets",
        f"checkpoint {cfg.checkpoint} is new, but tables {', '.join(holding)} hold commits of replica {cfg.name} "
        f"and not every table has one to resume from: starting from {cfg.source.starting_offsets!r} would leave out "
        "the changes before it that those tables have not applied",
        'set starting_offsets = "earliest" to read the log again into the tables (changes already applied are not '
        "applied again), or rebuild the replica into new tables",
    )


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
