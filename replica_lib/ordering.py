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
from dataclasses import dataclass
from functools import lru_cache

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from replica_lib.config import TableConfig
from replica_lib.target import sql_string

_MIN_SEQ = -(2**63)


@dataclass(frozen=True)
class LogOrder:
    """A table ordered by log position (no ``sequence_by``), whose versions compare within one partition only.

    Kafka orders a key's changes within the partition it sends them to. Changes of one key in two partitions (the
    topic gained partitions, or two producers partition keys differently) have no order the log can give, and
    ranking them by partition number would put an earlier change over a later one without a word. So every
    comparison of such a table's versions across partitions fails its Spark job instead, with Spark's
    ``USER_RAISED_EXCEPTION`` and a message naming the key (:meth:`refusal`), which
    :func:`replica_lib.recovery.key_across_partitions` turns into the replica's error.
    """

    table: str
    topic: str

    def _words(self) -> tuple[str, str, str, str]:
        """The message's text around the key and the two partitions."""
        return "key ", f" of table {self.table} has changes in partitions ", " and ", f" of topic {self.topic}"

    def refusal(self, key: Column, partition: Column, other: Column) -> Column:
        """An expression that fails the job, naming ``key`` (a JSON string) and the two partitions."""
        low, high = F.least(partition, other).cast("string"), F.greatest(partition, other).cast("string")
        before, between, joined, after = (F.lit(words) for words in self._words())
        return F.raise_error(F.concat(before, key, between, low, joined, high, after))

    def refusal_sql(self, key: str, partition: str, other: str) -> str:
        """:meth:`refusal` in Spark SQL, over SQL expressions."""
        before, between, joined, after = (sql_string(words) for words in self._words())
        low, high = f"CAST(LEAST({partition}, {other}) AS STRING)", f"CAST(GREATEST({partition}, {other}) AS STRING)"
        return f"raise_error(concat({before}, {key}, {between}, {low}, {joined}, {high}, {after}))"


def log_order(table: TableConfig) -> LogOrder | None:
    """The table's :class:`LogOrder` if it is ordered by log position (no ``sequence_by``), else None."""
    return LogOrder(table.name, table.topic) if table.sequence_by is None else None


def key_json(keys: Sequence[str], prefix: str = "") -> Column:
    """The key columns (each ``prefix + name``) as one JSON object, for a message."""
    return F.to_json(F.struct(*[F.col(f"{prefix}`{k}`").alias(k) for k in keys]))


def newer(
    seq: Column,
    partition: Column,
    offset: Column,
    than_seq: Column,
    than_partition: Column,
    than_offset: Column,
    across: Column | None = None,
) -> Column:
    """Whether version (seq, partition, offset) is greater than the other; anything beats no version.

    ``across``: the refusal (:meth:`LogOrder.refusal`) evaluated instead when the two versions are of different
    partitions, for a table ordered by log position.
    """
    lowest = F.lit(_MIN_SEQ).cast("long")
    a, b = F.coalesce(seq, lowest), F.coalesce(than_seq, lowest)
    greater = (
        than_offset.isNull()
        | (a > b)
        | ((a == b) & ((partition > than_partition) | ((partition == than_partition) & (offset > than_offset))))
    )
    if across is None:
        return greater
    return F.when(than_offset.isNotNull() & (partition != than_partition), across.cast("boolean")).otherwise(greater)


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


def latest_per_key(
    changes_df: DataFrame, keys: Sequence[str], current_df: DataFrame | None, by_log: LogOrder | None = None
) -> DataFrame:
    """One winning change per key, kept only if it is newer than the table's current version of that key.

    ``current_df`` holds ``keys + _cur_seq, _cur_partition, _cur_offset`` (see :func:`current_versions`) for the
    keys that have a known current version; None when no key has one (an empty table). ``by_log``: the table is
    ordered by log position, and a winner of another partition than its key's current version is refused.
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
    across = None
    if by_log is not None:
        across = by_log.refusal(key_json(keys), F.col("_partition"), F.col("_cur_partition"))
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
                across,
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


def one_per_key(
    changes_df: DataFrame, keys: Sequence[str], late: bool = False, by_log: LogOrder | None = None
) -> DataFrame:
    """The greatest version per key among the valid changes, and one copy of each rejected record.

    ``late``: add ``_late``, whether the key's last change in log order has a lower seq than its winner (a *late
    change*: Kafka's compaction keeps that last record, so a rebuild from a compacted log would keep it). A
    Kafka tombstone last is not late: it deletes the key in the replica as after compaction. ``by_log``: the
    table is ordered by log position, and a key with valid changes in two partitions is refused (in the same
    aggregation: the least and greatest partition of each key's changes).

    One aggregation (``max_by``, with a partial aggregation before its shuffle), so the decode's own job ranks the
    batch: no window. Spark runs it sort-based (its buffer, the whole change, is a struct, which a hash aggregation
    cannot hold): each side of the shuffle sorts by key what it aggregates. It is the ranking of
    :func:`latest_per_key` wherever no Kafka tombstone inherits a seq, i.e. on a table without ``sequence_by``
    (every seq is null, the log position decides) or in a batch without tombstones; a tombstone on a sequenced
    table needs the changes before it and the table's state.
    Rejected records (``_error`` set) are grouped by their log coordinates, so copies of one record count once.
    """
    group, aggregates, selected = _ranking(tuple(changes_df.columns), tuple(keys), late, by_log)
    return changes_df.groupBy(*group).agg(*aggregates).select(*selected)


@lru_cache(maxsize=64)
def _ranking(
    columns: tuple[str, ...], keys: tuple[str, ...], late: bool, by_log: LogOrder | None
) -> tuple[tuple[Column, ...], tuple[Column, ...], tuple[Column, ...]]:
    """The grouping, aggregates and output of :func:`one_per_key` for a frame of ``columns``: built once per
    schema, like the decode's expressions (they are the same for every batch)."""
    ok = F.col("_error").isNull()
    group = [F.when(ok, F.col(f"`{k}`")).alias(f"_group_{i}") for i, k in enumerate(keys)]
    group += [F.when(~ok, F.col(c)).alias(f"_group{c}") for c in _COORDINATES]
    version = version_of(F.col("_seq"), F.col("_partition"), F.col("_offset"))
    change = F.struct(*[F.col(f"`{c}`") for c in columns])
    fields = [F.col("_change")[c].alias(c) for c in columns]
    aggregates: tuple[Column, ...] = (F.max_by(change, version).alias("_change"),)
    if by_log is not None:  # a rejected record is a group of its own: one partition
        aggregates += (F.min("_partition").alias("_low"), F.max("_partition").alias("_high"))
        refused = by_log.refusal(key_json(keys, "_change."), F.col("_low"), F.col("_high")).cast("int")
        partition = F.when(F.col("_low") != F.col("_high"), refused).otherwise(F.col("_change._partition"))
        fields = [partition.alias(c) if c == "_partition" else field for c, field in zip(columns, fields, strict=True)]
    if not late:
        return tuple(group), aggregates, tuple(fields)
    # The key's last change in the log, beside its winner, in the same aggregation.
    last = F.max_by(F.struct(F.col("_seq"), F.col("_tombstone")), F.struct(F.col("_partition"), F.col("_offset")))
    is_late = (
        F.col("_change._error").isNull() & ~F.col("_last._tombstone") & (F.col("_last._seq") < F.col("_change._seq"))
    )
    aggregates += (last.alias("_last"),)
    return tuple(group), aggregates, (*fields, F.coalesce(is_late, F.lit(False)).alias("_late"))


def unapplied(
    winners_df: DataFrame, keys: Sequence[str], states_df: DataFrame | None, by_log: LogOrder | None = None
) -> DataFrame:
    """The winners newer than every known version of their key.

    ``states_df`` holds ``keys + _src_seq, _src_partition, _src_offset``, any number of rows per key (retained
    deletes, rows); a winner that one of them equals or passes is dropped (an anti join: no ranking of states).
    ``by_log``: the table is ordered by log position, and a winner of another partition than a state of its key
    is refused.
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
        None
        if by_log is None
        else by_log.refusal(
            F.to_json(F.struct(*[winners_df[f"`{k}`"].alias(k) for k in keys])),
            winners_df["_partition"],
            states_df["_src_partition"],
        ),
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
