"""Swap rebuilt tables in for a replica's live ones: readers see the old rows or the new, never an empty table.

A swap runs once the live replica has stopped (it waits for the replica's checkpoint lock), and then:

1. records the swap's plan in the rebuild's folder: how far the live replica had applied the log (``L``), the
   point both will stand at, ``T`` = per partition the later of ``L`` and the rebuild's end, and the version of
   the live quarantine's resolutions it goes by;
2. catches the rebuilt tables up to ``T`` (one more bulk batch of the rebuild, if the live replica had read past
   the rebuild's end), and gives them the live replica's resolutions: the rebuild's quarantine started empty, so
   it holds each key behind that key's bad record again. The records the operator dropped from the live
   quarantine are dropped from the rebuild's and the rebuild's records they held are replayed into its tables, as
   they were into the live ones; a record the live replica applied after a fix (replayed) that the rebuild still
   rejects stops the swap here, before any live table changes;
3. folds a merge-on-read live table's pending changes, so that its base alone shows its state;
4. replaces each live table's rows with the rebuilt table's in **one Delta commit** (retained deletes first, the
   table last): a reader by path or by catalog name sees the version before or the version after, and time travel
   keeps the old versions. The commit records ``T`` as a replica commit does;
5. makes the live quarantine hold back what the rebuilt tables do: the rebuild's unresolved records it lacks are
   added (those past ``L``, which the live replica never read, and any the rebuild alone rejected), and its
   unresolved records that the rebuild applied are listed as replayed;
6. moves the live checkpoint aside (``<checkpoint>.before-swap-<id>``). Started again, the replica finds no
   checkpoint, resumes from ``T`` recorded in its tables (:func:`replica_lib.recovery.starting_offsets`) under a
   new checkpoint generation, and applies every later record exactly once.

Every write is idempotent (``txnAppId`` of the swap's id, ``txnVersion`` 0): a swap killed at any point and run
again finishes the same plan; run again after it finished, it says so and changes nothing. Delta has no commit
across tables, so a replica's tables are swapped one after another, as its batches write them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from replica_lib.config import ReplicaConfig, TableConfig
from replica_lib.errors import RebuildError, VerifyError
from replica_lib.layout import fold
from replica_lib.merge import Commit, append_quarantine, replace_rows, typed_conflicts
from replica_lib.progress import (
    SWAP_GENERATION,
    Offsets,
    offsets_json,
    parse_offsets,
    path_exists,
    read_text,
    rename_path,
    write_text,
)
from replica_lib.quarantine import COORDINATES, DROPPED, REPLAYED, resolutions, resolutions_version, resolve, unresolved
from replica_lib.rebuild import (
    SWAPPED_FILE,
    Plan,
    apply_range,
    check_rebuilt_topics,
    rebuild_config,
    rebuild_session,
    recorded_plan,
    topic_ids_now,
)
from replica_lib.recovery import (
    applied_so_far,
    check_topics_kept,
    checkpoint_is_local,
    lock_checkpoint,
    release_checkpoint,
    wait_until_stopped,
)
from replica_lib.replay import replay_locked
from replica_lib.target import (
    TableSchema,
    changes_target,
    ensure_replica_tables,
    is_empty,
    read_table,
    table_exists,
    tombstone_target,
)
from replica_lib.verify import compare_tables, report

logger = logging.getLogger(__name__)

SWAP_FILE = "_swap.json"
CATCH_UP_FILE = "_catch_up.json"

#: The named points of a swap, in order, for crash tests (each is passed to ``at``).
SWAP_POINTS = (
    "after_plan",
    "after_catch_up",
    "after_rebuild_drops",
    "after_live_fold",
    "after_tombstones",
    "after_table",
    "after_quarantine",
)


@dataclass(frozen=True)
class SwapPlan:
    """One swap: its id, where the live replica had stopped (``applied``) and where both stand after (``ends``)."""

    swap_id: str
    applied: Offsets
    ends: Offsets
    #: The live quarantine's list of resolutions as the swap read it (-1: none yet; None: a plan from before this
    #: was recorded, read as it is): a drop made while the swap runs is the live replica's own, not the rebuild's.
    resolved_version: int | None = None

    def to_json(self) -> str:
        plan: dict[str, object] = {
            "swap_id": self.swap_id,
            "applied": offsets_json(self.applied),
            "ends": offsets_json(self.ends),
        }
        if self.resolved_version is not None:
            plan["resolved_version"] = self.resolved_version
        return json.dumps(plan, sort_keys=True)

    @staticmethod
    def parse(text: str) -> SwapPlan:
        data = json.loads(text)
        version = data.get("resolved_version")
        return SwapPlan(
            str(data["swap_id"]),
            parse_offsets(data["applied"]),
            parse_offsets(data["ends"]),
            None if version is None else int(version),
        )


@dataclass(frozen=True)
class Swapped:
    """What a swap did. ``paused_s``: from the live replica's stop (its lock taken) to its checkpoint moved aside."""

    plan: SwapPlan
    checkpoint_aside: str
    paused_s: float
    caught_up: int = 0  # records applied to the rebuilt tables after the rebuild's end
    caught_up_stopped: int = 0  # of which while the live replica was stopped
    already: bool = False  # an earlier run had finished this swap
    verified: list[str] = field(default_factory=list)  # one report line per table, with --verify


def aside_path(cfg: ReplicaConfig, swap_id: str) -> str:
    return f"{cfg.checkpoint.rstrip('/')}.before-swap-{swap_id}"


def swap(
    spark: SparkSession,
    cfg: ReplicaConfig,
    root: str,
    wait_s: float = 3600.0,
    live_stopped: bool = False,
    verify: bool = False,
    at: Callable[[str], None] | None = None,
) -> Swapped:
    """Swap the tables rebuilt under ``root`` in for replica ``cfg``'s live tables (see the module's steps).

    ``wait_s``: how long to wait for the live replica to stop. ``live_stopped``: the operator's word that it has,
    for a checkpoint on shared storage, where no lock can tell. ``verify``: compare live and rebuilt tables before
    the swap (a report of what it changes; it does not stop the swap).
    """
    shadow = rebuild_config(cfg, root)
    lock_checkpoint(shadow)
    session = rebuild_session(spark)
    rebuilt = recorded_plan(session, shadow)
    if rebuilt is None:
        raise RebuildError(f"{root} holds no rebuild of replica {cfg.name}: rebuild into it first")
    # Neither the rebuilt tables nor the live ones may hold a topic that was deleted and created again since.
    ids = topic_ids_now(cfg)
    check_rebuilt_topics(shadow, rebuilt, ids)
    check_topics_kept(session, cfg, ids)
    path = f"{shadow.checkpoint}/{SWAP_FILE}"
    recorded = SwapPlan.parse(read_text(session, path)) if path_exists(session, path) else None
    swapped = path_exists(session, f"{shadow.checkpoint}/{SWAPPED_FILE}")  # or, by a swap before it was written:
    if recorded is not None and (swapped or path_exists(session, aside_path(cfg, recorded.swap_id))):
        logger.info("swap %s: finished already (its old checkpoint is %s)", cfg.name, aside_path(cfg, recorded.swap_id))
        return Swapped(recorded, aside_path(cfg, recorded.swap_id), 0.0, already=True)
    position = _resume_catch_up(session, shadow, rebuilt)
    if recorded is None:  # while the live replica runs, catch up to it: the pause then has little left to apply
        position = _catch_up(session, shadow, rebuilt, position, _later(position[1], applied_so_far(session, cfg)))
    stopped_at = _wait_for_the_replica(cfg, wait_s, live_stopped)
    if recorded is None:
        applied = applied_so_far(session, cfg) or {}
        recorded = SwapPlan(uuid.uuid4().hex[:12], applied, {}, resolutions_version(session, cfg))
        recorded = replace(recorded, ends=_later(position[1], recorded.applied))
        write_text(session, path, recorded.to_json())
    _at(at, "after_plan")
    before = position[2]
    position = _catch_up(session, shadow, rebuilt, position, recorded.ends)
    _at(at, "after_catch_up")
    _settle_quarantine(session, cfg, shadow, recorded, at)
    pairs = list(zip(cfg.tables, shadow.tables, strict=True))
    verified = [_verify(session, cfg, shadow, live, new) for live, new in pairs] if verify else []
    live_schemas = ensure_replica_tables(session, cfg)
    with typed_conflicts():
        for live, new in pairs:
            schema = live_schemas[live.name] if live.merge_on_read else None
            _replace_table(session, cfg, recorded, ids, live, new, schema, at)
        _copy_quarantine(session, cfg, shadow, recorded)
    _at(at, "after_quarantine")
    aside = aside_path(cfg, recorded.swap_id)
    if path_exists(session, cfg.checkpoint):
        rename_path(session, cfg.checkpoint, aside)
    done = {"swap_id": recorded.swap_id, "checkpoint_aside": aside}
    write_text(session, f"{shadow.checkpoint}/{SWAPPED_FILE}", json.dumps(done, sort_keys=True))
    release_checkpoint(cfg)
    paused = time.monotonic() - stopped_at
    logger.info("swap %s: done; the old checkpoint is %s; the replica was stopped for %.1f s", cfg.name, aside, paused)
    return Swapped(recorded, aside, paused, position[2], position[2] - before, verified=verified)


def _wait_for_the_replica(cfg: ReplicaConfig, wait_s: float, live_stopped: bool) -> float:
    if not checkpoint_is_local(cfg):
        if not live_stopped:
            raise RebuildError(
                f"replica {cfg.name}'s checkpoint {cfg.checkpoint} is not on a local disk, so the swap cannot tell "
                "whether the replica is running: stop it, then swap with --live-stopped"
            )
        return time.monotonic()

    def waiting() -> None:
        logger.warning(
            "swap %s: the replica is running on %s; waiting up to %.0f s for it to stop (send it SIGTERM: it "
            "finishes its batch and exits)",
            cfg.name,
            cfg.checkpoint,
            wait_s,
        )

    return wait_until_stopped(cfg, wait_s, waiting)


def _later(ends: Offsets, other: Offsets | None) -> Offsets:
    """Per topic and partition, the later of two positions."""
    later: Offsets = {}
    other = other or {}
    for topic in sorted(set(ends) | set(other)):
        mine, theirs = ends.get(topic, {}), other.get(topic, {})
        later[topic] = {p: max(mine.get(p, 0), theirs.get(p, 0)) for p in sorted(set(mine) | set(theirs))}
    return later


#: Where the rebuilt tables stand: (batch id of their last catch-up, its end offsets, records caught up so far).
_Position = tuple[int, Offsets, int]


def _resume_catch_up(spark: SparkSession, shadow: ReplicaConfig, rebuilt: Plan) -> _Position:
    """Where the rebuilt tables stand, finishing the last catch-up an earlier run recorded (writes are skipped if
    they were committed)."""
    path = f"{shadow.checkpoint}/{CATCH_UP_FILE}"
    if not path_exists(spark, path):
        return 0, rebuilt.ends, 0
    last = json.loads(read_text(spark, path))
    batch_id, starts, ends = int(last["batch_id"]), parse_offsets(last["starts"]), parse_offsets(last["ends"])
    records = apply_range(spark, shadow, rebuilt, batch_id, ends, starts).records
    return batch_id, ends, records


def _catch_up(
    spark: SparkSession, shadow: ReplicaConfig, rebuilt: Plan, position: _Position, ends: Offsets
) -> _Position:
    """Apply the records from ``position`` up to ``ends`` to the rebuilt tables as their next batch (recorded first,
    so that a run after a crash applies the same range under the same batch id)."""
    batch_id, starts, records = position
    if _later(starts, ends) == starts:
        return position
    starts = {t: {p: starts.get(t, {}).get(p, 0) for p in parts} for t, parts in ends.items()}
    record = {"batch_id": batch_id + 1, "starts": offsets_json(starts), "ends": offsets_json(ends)}
    write_text(spark, f"{shadow.checkpoint}/{CATCH_UP_FILE}", json.dumps(record, sort_keys=True))
    applied = apply_range(spark, shadow, rebuilt, batch_id + 1, ends, starts).records
    logger.info("swap %s: rebuilt tables caught up to %s (%d records)", shadow.name, offsets_json(ends), applied)
    return batch_id + 1, ends, records + applied


def _verify(spark: SparkSession, cfg: ReplicaConfig, shadow: ReplicaConfig, live: TableConfig, new: TableConfig) -> str:
    if not table_exists(spark, live.target):
        return f"{cfg.name}.{live.name}: no live table yet"
    try:
        comparison = compare_tables(spark, (cfg, live), (shadow, new))
    except VerifyError as exc:
        return f"{cfg.name}.{live.name}: not compared: {exc}"
    return report(f"{cfg.name}.{live.name}", f"rebuilt {new.name}", comparison)


def _replace_table(
    spark: SparkSession,
    cfg: ReplicaConfig,
    plan: SwapPlan,
    topic_ids: Mapping[str, str],
    live: TableConfig,
    new: TableConfig,
    merge_on_read: TableSchema | None,
    at: Callable[[str], None] | None,
) -> None:
    """Replace one live table's rows (and its retained deletes, change log) with the rebuilt one's. Its commits
    record the topics' ids, as a batch's do: the replica's next start checks them."""
    metadata: dict[str, object] = {
        "replica": cfg.name,
        "batch_id": 0,
        "generation": f"{SWAP_GENERATION}{plan.swap_id}",
        "offsets": offsets_json(plan.ends),
        "sequence_by": {t.name: t.sequence_by for t in cfg.tables},  # the rebuild's, which is the config's
    }
    if topic_ids:
        metadata["topic_ids"] = dict(topic_ids)

    def commit(label: str) -> Commit:
        return Commit(f"replica:{cfg.name}:{label}:swap-{plan.swap_id}", 0, metadata)

    if merge_on_read is not None:
        logger.info("swap %s: %s", cfg.name, fold(spark, cfg.name, merge_on_read).line(live.name))
    _at(at, "after_live_fold")
    replace_rows(tombstone_target(live), read_table(spark, tombstone_target(new)), commit(f"{live.name}:tombstones"))
    _at(at, "after_tombstones")
    replace_rows(live.target, read_table(spark, new.target), commit(live.name))
    if live.merge_on_read:  # the rebuilt change log is empty (folded); its commit records where the table stands
        replace_rows(changes_target(live), read_table(spark, changes_target(new)), commit(f"{live.name}:changes"))
    logger.info(
        "swap %s: %s now holds the rebuilt rows (at %s)", cfg.name, live.target.describe(), offsets_json(plan.ends)
    )
    _at(at, "after_table")


def _settle_quarantine(
    spark: SparkSession, cfg: ReplicaConfig, shadow: ReplicaConfig, plan: SwapPlan, at: Callable[[str], None] | None
) -> None:
    """Give the rebuilt tables the live replica's resolutions, as ``plan`` pinned them (step 2 of the module's).

    Without them, a key the operator released in the live replica (a drop, then a replay) would be swapped in at its
    state before the bad record, a delete undone, with nothing left to hold it. The rebuild's records the live
    replica still holds unresolved stay held in the rebuild too: a drop alone releases nothing."""
    live = resolutions(spark, cfg, plan.resolved_version)
    held = unresolved(spark, shadow)
    if live is None or held is None:
        return
    dropped = held.join(live.where(F.col("action") == DROPPED).select(*COORDINATES), COORDINATES, "left_semi")
    if not dropped.isEmpty():
        resolve(spark, shadow, dropped, DROPPED, f"dropped from replica {cfg.name}'s quarantine (swap {plan.swap_id})")
    _at(at, "after_rebuild_drops")
    own = resolutions(spark, shadow)
    if own is not None and not own.where(F.col("action") == DROPPED).isEmpty():
        # Run again after a crash too: what a replay applied is resolved, and the MERGE's gate finds it applied.
        waiting = unresolved(spark, cfg, plan.resolved_version)
        released = held if waiting is None else held.join(waiting.select(*COORDINATES), COORDINATES, "left_anti")
        note = f"released as in replica {cfg.name} (swap {plan.swap_id})"
        replayed = replay_locked(spark, shadow, note=note, only=released)
        logger.info("swap %s: %s", cfg.name, replayed.line(f"{cfg.name} (rebuilt)"))
        for schema in ensure_replica_tables(spark, shadow).values():  # folded, as the rebuild leaves its tables
            if schema.table.merge_on_read and not is_empty(spark, changes_target(schema.table)):
                logger.info("swap %s: %s", cfg.name, fold(spark, shadow.name, schema).line(schema.table.name))
    # Against the list as it is now: a replay in the live replica after the plan (its lock is not the swap's to hold
    # on shared storage) applied a change that these tables would not have.
    now = resolutions(spark, cfg)
    still = unresolved(spark, shadow)
    assert now is not None and still is not None
    applied = still.join(now.where(F.col("action") == REPLAYED).select(*COORDINATES), COORDINATES, "left_semi")
    lost = applied.select(*COORDINATES).orderBy(*COORDINATES).limit(4).collect()
    if lost:
        places = ", ".join(f"{r['topic']}/{r['partition']}/{r['offset']}" for r in lost[:3])
        raise RebuildError(
            f"the rebuild of replica {cfg.name} rejects records that the live replica applied after a fix (replayed "
            f"from its quarantine): {places}{', ...' if len(lost) > 3 else ''}; swapped in, their changes would be "
            f"lost. Put the fix the replay used into {cfg.source_file} and rebuild into a new folder"
        )


def _copy_quarantine(spark: SparkSession, cfg: ReplicaConfig, shadow: ReplicaConfig, plan: SwapPlan) -> None:
    """The live quarantine holds back what the rebuilt tables do: the rebuild's unresolved records it lacks (those
    past where the live replica had stopped, which it never read, and any other the rebuild rejected) are added, and
    its unresolved records the rebuild applied are listed as replayed (their keys are no longer held)."""
    held = unresolved(spark, shadow)
    if held is None:
        return
    live = read_table(spark, cfg.quarantine).select(*COORDINATES) if table_exists(spark, cfg.quarantine) else None
    lacking = held if live is None else held.join(live, COORDINATES, "left_anti")
    app = f"replica:{cfg.name}:_quarantine:swap-{plan.swap_id}"
    commit = Commit(app, 0, {"replica": cfg.name, "swap": plan.swap_id})
    append_quarantine(cfg.quarantine, lacking.select(*read_table(spark, shadow.quarantine).columns), commit)
    waiting = unresolved(spark, cfg)
    if waiting is not None:
        applied = waiting.join(held.select(*COORDINATES), COORDINATES, "left_anti")
        if not applied.isEmpty():
            note = f"the rebuild swapped in (swap {plan.swap_id}) does not hold it back: applied, or gone from the log"
            resolve(spark, cfg, applied, REPLAYED, note)


def _at(at: Callable[[str], None] | None, point: str) -> None:
    if at is not None:
        at(point)
