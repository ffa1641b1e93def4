"""One winning change per key, by version: this also drops records delivered twice.

The order of changes (docs/design.md §3): a change's *version* is ``(seq, partition, offset)``; the greatest wins, and
a change never overwrites a state of greater or equal version. Without a sequence (``sequence_by`` unset) every
seq is null, so the version is the log position. A Kafka tombstone carries no seq: it deletes the key *at its
place in the log*, taking the seq of the state it deletes (the table's, or that of the latest change before it
in the same batch), so a change with a greater seq, or an equal seq later in the log, comes after it.

Deduplication by log coordinates (topic, partition, offset) needs no step of its own: copies of one record have
the same key and the same version, so the ranking keeps one of them, and a copy changes neither what wins nor the
seq a Kafka tombstone inherits. Across batches, a record delivered again meets a state of equal version and is
not applied (see :func:`newer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

_MIN_SEQ = -(2**63)


def newer(
    seq: Column,
    partition: Column,
    offset: Column,
    than_seq: Column,
    than_partition: Column,
    than_offset: Column,
) -> Column:
    """Whether version (seq, partition, offset) is greater than the other; anything beats no version."""
    lowest = F.lit(_MIN_SEQ).cast("long")
    a, b = F.coalesce(seq, lowest), F.coalesce(than_seq, lowest)
    return (
        than_offset.isNull()
        | (a > b)
        | ((a == b) & ((partition > than_partition) | ((partition == than_partition) & (offset > than_offset))))
    )


def current_versions(keys: Sequence[str], *states: DataFrame) -> DataFrame:
    """The greatest version per key among ``states`` (each: keys + ``_src_seq, _src_partition, _src_offset``)."""
    union = states[0]
    for state in states[1:]:
        union = union.unionByName(state)
    ranked = Window.partitionBy(*keys).orderBy(
        F.col("_src_seq").desc_nulls_last(), F.col("_src_partition").desc(), F.col("_src_offset").desc()
    )
    return (
        union.withColumn("_rank", F.row_number().over(ranked))
        .where(F.col("_rank") == 1)
        .select(
            *keys,
            F.col("_src_seq").alias("_cur_seq"),
            F.col("_src_partition").alias("_cur_partition"),
            F.col("_src_offset").alias("_cur_offset"),
        )
    )


def latest_per_key(changes_df: DataFrame, keys: Sequence[str], current_df: DataFrame | None) -> DataFrame:
    """One winning change per key, kept only if it is newer than the table's current version of that key.

    ``current_df`` holds ``keys + _cur_seq, _cur_partition, _cur_offset`` (see :func:`current_versions`) for the
    keys that have a known current version; None when no key has one (an empty table).
    """
    in_log_order = Window.partitionBy(*keys).orderBy("_partition", "_offset")
    before = in_log_order.rowsBetween(Window.unboundedPreceding, -1)
    by_version = Window.partitionBy(*keys).orderBy(
        F.col("_seq").desc_nulls_last(), F.col("_partition").desc(), F.col("_offset").desc()
    )
    if current_df is None:
        with_state = changes_df.select(
            "*",
            F.lit(None).cast("long").alias("_cur_seq"),
            F.lit(None).cast("int").alias("_cur_partition"),
            F.lit(None).cast("long").alias("_cur_offset"),
        )
    else:
        with_state = changes_df.join(current_df, list(keys), "left")
    inherited = F.greatest(F.max("_seq").over(before), F.col("_cur_seq"))
    return (
        with_state.withColumn("_seq", F.when(F.col("_tombstone"), inherited).otherwise(F.col("_seq")))
        .withColumn("_rank", F.row_number().over(by_version))
        .where(F.col("_rank") == 1)
        .where(
            newer(
                F.col("_seq"),
                F.col("_partition"),
                F.col("_offset"),
                F.col("_cur_seq"),
                F.col("_cur_partition"),
                F.col("_cur_offset"),
            )
        )
        .drop("_rank", "_cur_seq", "_cur_partition", "_cur_offset")
    )


def version_of(seq: Column, partition: Column, offset: Column) -> Column:
    """A change's version as one orderable value: ``(seq, partition, offset)``, a missing seq lowest."""
    return F.struct(
        F.coalesce(seq, F.lit(_MIN_SEQ).cast("long")).alias("seq"),
        partition.alias("partition"),
        offset.alias("offset"),
    )


#: A rejected change's place in the log: what keeps it apart from every other record in :func:`one_per_key`.
_COORDINATES = ("_topic", "_partition", "_offset")


def one_per_key(changes_df: DataFrame, keys: Sequence[str], late: bool = False) -> DataFrame:
    """The greatest version per key among the valid changes, and one copy of each rejected record.

    ``late``: add ``_late``, whether the key's last change in log order has a lower seq than its winner (a *late
    change*: Kafka's compaction keeps that last record, so a rebuild from a compacted log would keep it). A
    Kafka tombstone last is not late: it deletes the key in the replica as after compaction.

    One aggregation (``max_by``, with a partial aggregation before its shuffle), so the decode's own job ranks the
    batch: no window. Spark runs it sort-based (its buffer, the whole change, is a struct, which a hash aggregation
    cannot hold): each side of the shuffle sorts by key what it aggregates. It is the ranking of
    :func:`latest_per_key` wherever no Kafka tombstone inherits a seq, i.e. on a table without ``sequence_by``
    (every seq is null, the log position decides) or in a batch without tombstones; a tombstone on a sequenced
    table needs the changes before it and the table's state.
    Rejected records (``_error`` set) are grouped by their log coordinates, so copies of one record count once.
    """
    group, aggregates, selected = _ranking(tuple(changes_df.columns), tuple(keys), late)
    return changes_df.groupBy(*group).agg(*aggregates).select(*selected)


@lru_cache(maxsize=64)
def _ranking(
    columns: tuple[str, ...], keys: tuple[str, ...], late: bool
) -> tuple[tuple[Column, ...], tuple[Column, ...], tuple[Column, ...]]:
    """The grouping, aggregates and output of :func:`one_per_key` for a frame of ``columns``: built once per
    schema, like the decode's expressions (they are the same for every batch)."""
    ok = F.col("_error").isNull()
    group = [F.when(ok, F.col(f"`{k}`")).alias(f"_group_{i}") for i, k in enumerate(keys)]
    group += [F.when(~ok, F.col(c)).alias(f"_group{c}") for c in _COORDINATES]
    version = version_of(F.col("_seq"), F.col("_partition"), F.col("_offset"))
    change = F.struct(*[F.col(f"`{c}`") for c in columns])
    fields = [F.col("_change")[c].alias(c) for c in columns]
    if not late:
        return tuple(group), (F.max_by(change, version).alias("_change"),), tuple(fields)
    # The key's last change in the log, beside its winner, in the same aggregation.
    last = F.max_by(F.struct(F.col("_seq"), F.col("_tombstone")), F.struct(F.col("_partition"), F.col("_offset")))
    is_late = (
        F.col("_change._error").isNull() & ~F.col("_last._tombstone") & (F.col("_last._seq") < F.col("_change._seq"))
    )
    aggregates = (F.max_by(change, version).alias("_change"), last.alias("_last"))
    return tuple(group), aggregates, (*fields, F.coalesce(is_late, F.lit(False)).alias("_late"))


def unapplied(winners_df: DataFrame, keys: Sequence[str], states_df: DataFrame | None) -> DataFrame:
    """The winners newer than every known version of their key.

    ``states_df`` holds ``keys + _src_seq, _src_partition, _src_offset``, any number of rows per key (retained
    deletes, rows); a winner that one of them equals or passes is dropped (an anti join: no ranking of states).
    """
    if states_df is None:
        return winners_df
    on = [winners_df[f"`{k}`"] == states_df[f"`{k}`"] for k in keys]
    stale = ~newer(
        winners_df["_seq"],
        winners_df["_partition"],
        winners_df["_offset"],
        states_df["_src_seq"],
        states_df["_src_partition"],
        states_df["_src_offset"],
    )
    condition = on[0]
    for term in [*on[1:], stale]:
        condition = condition & term
    return winners_df.join(states_df, condition, "left_anti")


def held(
    changes_df: DataFrame, keys: Sequence[str], table: str, earlier_df: DataFrame | None, broadcast: bool
) -> DataFrame:
    """``changes_df`` with the valid changes that a quarantined record of their key holds back marked rejected.

    A record of ``table`` rejected with its key read holds the later records of its key (log position: partition,
    then offset), so that no state after it is applied before it is replayed or dropped; ``earlier_df`` holds the
    keys held by records quarantined in earlier batches, which hold every change of their key. A held change gets
    an ``_error`` that says so: the batch quarantines it with the record that holds it.
    """
    ok = F.col("_error").isNull()
    known = F.lit(True)
    for k in keys:
        known = known & F.col(f"`{k}`").isNotNull()
    position = F.struct(F.col("_partition").alias("partition"), F.col("_offset").alias("offset"))
    poison = (
        changes_df.where(~ok & known & (F.col("_table") == table)).groupBy(*keys).agg(F.min(position).alias("_poison"))
    )
    if earlier_df is not None:
        before = F.struct(F.lit(-1).alias("partition"), F.lit(-1).cast("long").alias("offset"))
        earlier = earlier_df.select(*keys, before)
        poison = (
            poison.unionByName(earlier.toDF(*keys, "_poison")).groupBy(*keys).agg(F.min("_poison").alias("_poison"))
        )
    joined = changes_df.join(F.broadcast(poison) if broadcast else poison, list(keys), "left")
    is_held = ok & F.col("_poison").isNotNull() & (position > F.col("_poison"))
    reason = F.lit(
        "held behind an earlier quarantined record of its key (on_poison = hold_key): "
        "replay or drop that record with ./replica quarantine"
    )
    return joined.withColumn("_error", F.when(is_held, reason).otherwise(F.col("_error"))).select(
        *[F.col(f"`{c}`") for c in changes_df.columns]
    )
