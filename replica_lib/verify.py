"""Compare two replica tables recorded at the same offsets: live vs rebuilt, or two replicas of one log.

Each row is hashed (every column, provenance included: the same winning record must have set it) and the hashes
are summed per bucket of keys; only buckets whose sums or counts differ are joined key by key, so equal tables
cost two aggregations and no join.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from replica_lib.config import ReplicaConfig, TableConfig
from replica_lib.errors import VerifyError
from replica_lib.layout import read_state
from replica_lib.progress import applied_offsets
from replica_lib.target import applied_target, table_exists

#: Buckets of keys the fingerprints are summed in.
BUCKETS = 1024


@dataclass(frozen=True)
class Comparison:
    """The outcome: whether the tables are equal, how many buckets differ, and the first differing keys."""

    equal: bool
    rows: tuple[int, int]
    buckets_differing: int
    differences: tuple[dict[str, Any], ...]  # key columns, and which side has what ("left", "right": row or None)


def fingerprints(table_df: DataFrame, keys: list[str], buckets: int = BUCKETS) -> DataFrame:
    """Per bucket of keys: its rows and the sum of their hashes (``bucket, rows, fingerprint``)."""
    columns = sorted(table_df.columns)
    row_hash = F.xxhash64(*[F.col(f"`{c}`") for c in columns]).cast("decimal(38,0)")
    bucket = F.pmod(F.xxhash64(*[F.col(f"`{k}`") for k in keys]), F.lit(buckets))
    return (
        table_df.select(bucket.alias("bucket"), row_hash.alias("h"))
        .groupBy("bucket")
        .agg(F.count(F.lit(1)).alias("rows"), F.sum("h").alias("fingerprint"))
    )


def compare(
    left_df: DataFrame, right_df: DataFrame, keys: list[str], buckets: int = BUCKETS, limit: int = 10
) -> Comparison:
    """Compare two tables of the same columns by key; lists up to ``limit`` differing keys."""
    if sorted(left_df.columns) != sorted(right_df.columns):
        raise VerifyError(
            f"the tables have different columns ({', '.join(sorted(set(left_df.columns) ^ set(right_df.columns)))})"
        )
    left_fp = fingerprints(left_df, keys, buckets).alias("l")
    right_fp = fingerprints(right_df, keys, buckets).alias("r")
    joined = left_fp.join(right_fp, "bucket", "full_outer")
    differing = [
        int(row["bucket"])
        for row in joined.where(
            ~F.col("l.rows").eqNullSafe(F.col("r.rows")) | ~F.col("l.fingerprint").eqNullSafe(F.col("r.fingerprint"))
        )
        .select("bucket")
        .collect()
    ]
    totals = joined.agg(F.sum("l.rows"), F.sum("r.rows")).first()
    rows = (int(totals[0] or 0), int(totals[1] or 0)) if totals else (0, 0)
    if not differing:
        return Comparison(True, rows, 0, ())
    return Comparison(False, rows, len(differing), _differences(left_df, right_df, keys, buckets, differing, limit))


def _differences(
    left_df: DataFrame, right_df: DataFrame, keys: list[str], buckets: int, differing: list[int], limit: int
) -> tuple[dict[str, Any], ...]:
    """The first differing keys of the differing buckets, with each side's row (None where a side lacks the key)."""
    bucket = F.pmod(F.xxhash64(*[F.col(f"`{k}`") for k in keys]), F.lit(buckets))
    columns = sorted(left_df.columns)

    def side(frame: DataFrame, name: str) -> DataFrame:
        body = F.to_json(F.struct(*[F.col(f"`{c}`") for c in columns]))
        return frame.where(bucket.isin(differing)).select(*[F.col(f"`{k}`") for k in keys], body.alias(name))

    pairs = side(left_df, "left").join(side(right_df, "right"), keys, "full_outer")
    rows = (
        pairs.where(~F.col("left").eqNullSafe(F.col("right")))
        .orderBy(*[F.col(f"`{k}`") for k in keys])
        .limit(limit)
        .collect()
    )
    return tuple(
        {
            **{k: row[k] for k in keys},
            "left": json.loads(row["left"]) if row["left"] else None,
            "right": json.loads(row["right"]) if row["right"] else None,
        }
        for row in rows
    )


def compare_tables(
    spark: SparkSession, left: tuple[ReplicaConfig, TableConfig], right: tuple[ReplicaConfig, TableConfig]
) -> Comparison:
    """Compare a table of two replicas (or a replica and its rebuild) that have applied the log to the same offsets.

    Raises :class:`VerifyError` if they are recorded at different offsets (say which, and how to compare them).
    """
    (lcfg, ltable), (rcfg, rtable) = left, right
    if list(ltable.keys) != list(rtable.keys):
        raise VerifyError(f"{ltable.name} is keyed by {list(ltable.keys)}, {rtable.name} by {list(rtable.keys)}")
    for cfg, table in (left, right):
        if not table_exists(spark, table.target):
            raise VerifyError(
                f"replica {cfg.name} has no table {table.name} at {table.target.describe()} yet: run it (or the "
                "rebuild) first"
            )
    lapplied = applied_offsets(spark, applied_target(ltable))
    rapplied = applied_offsets(spark, applied_target(rtable))
    lat, rat = (lapplied.offsets if lapplied else {}), (rapplied.offsets if rapplied else {})
    if lat != rat:
        raise VerifyError(
            f"the tables are at different points of the log: {lcfg.name}.{ltable.name} at {_offsets(lat)}, "
            f"{rcfg.name}.{rtable.name} at {_offsets(rat)}; rebuild one with --until at the other's offsets "
            "(or let both drain the log) to compare them"
        )
    return compare(read_state(spark, ltable), read_state(spark, rtable), list(ltable.keys))


def _offsets(offsets: dict[str, dict[int, int]]) -> str:
    if not offsets:
        return "nothing applied"
    return " ".join(f"{t}:" + ",".join(f"{p}={o}" for p, o in sorted(parts.items())) for t, parts in offsets.items())


def report(left: str, right: str, comparison: Comparison) -> str:
    """A few lines for people: equal or not, and the first differing keys with each side's row."""
    lrows, rrows = comparison.rows
    if comparison.equal:
        return f"{left} and {right} are equal: {lrows} rows"
    lines = [
        f"{left} ({lrows} rows) and {right} ({rrows} rows) differ in {comparison.buckets_differing} of "
        f"{BUCKETS} key buckets; first differing keys:"
    ]
    for diff in comparison.differences:
        key = {k: v for k, v in diff.items() if k not in ("left", "right")}
        lines.append(f"  {json.dumps(key, default=str)}: {left} {_row(diff['left'])}, {right} {_row(diff['right'])}")
    return "\n".join(lines)


def _row(row: dict[str, Any] | None) -> str:
    return "has no row" if row is None else json.dumps(row, default=str, sort_keys=True)
