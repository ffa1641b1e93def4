"""The replica's compaction gives way to a concurrent commit (a warning, packed next time) and to nothing else.

The errors are real JVM exceptions thrown through py4j, as Delta's are: Delta's conflict classes, one of them as
the cause of another exception, and an error whose message names a conflict but whose class is not one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import reduce
from pathlib import Path

import pytest
from py4j.protocol import Py4JJavaError
from pyspark.errors.exceptions.captured import CapturedException
from pyspark.sql import SparkSession

from replica_lib import batch, merge
from replica_lib.config import Target
from replica_lib.errors import (
    ConcurrentAppendError,
    ConcurrentCommitError,
    ConcurrentDeleteDeleteError,
    ConcurrentDeleteReadError,
)

MIN_FILE_SIZE = "spark.databricks.delta.optimize.minFileSize"
DELETE_READ = "[DELTA_CONCURRENT_DELETE_READ] This transaction attempted to read one or more files that were deleted"


def thrower(spark: SparkSession, jvm_class: str, message: str, wrapped: bool = False) -> Callable[[], None]:
    """Throw a new ``jvm_class(message)`` in the JVM (as the cause of an ExecutionException if ``wrapped``)."""

    def throw() -> None:
        jvm = spark._jvm
        assert jvm is not None
        exc = reduce(getattr, jvm_class.split("."), jvm)(message)
        if wrapped:
            jvm.java.util.concurrent.CompletableFuture.failedFuture(exc).get()
        jvm.scala.util.Failure(exc).get()

    return throw


class _Refusing:
    """A table whose OPTIMIZE fails as ``throw`` does."""

    def __init__(self, throw: Callable[[], None]) -> None:
        self.throw = throw

    def optimize(self) -> None:
        self.throw()


def _refuse(monkeypatch: pytest.MonkeyPatch, throw: Callable[[], None]) -> None:
    monkeypatch.setattr(merge, "delta_table", lambda _spark, _target: _Refusing(throw))


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_compaction_a_concurrent_commit_won_is_left_for_the_next(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wrapped: bool
) -> None:
    before = spark.conf.get(MIN_FILE_SIZE, None)
    _refuse(monkeypatch, thrower(spark, "io.delta.exceptions.ConcurrentDeleteReadException", DELETE_READ, wrapped))
    with caplog.at_level(logging.WARNING, logger="replica_lib.merge"):
        assert merge.compact_files(spark, Target(path="/r/orders"), 16 << 20) is None
    assert (
        "compacting delta.`/r/orders`: a concurrent commit won, packed at the next compaction "
        f"(ConcurrentDeleteReadError: {DELETE_READ})" in caplog.text
    )
    assert spark.conf.get(MIN_FILE_SIZE, None) == before  # the session's OPTIMIZE settings are restored


@pytest.mark.parametrize(
    ("jvm_class", "error"),
    [
        ("io.delta.exceptions.ConcurrentDeleteReadException", ConcurrentDeleteReadError),
        ("io.delta.exceptions.ConcurrentTransactionException", ConcurrentCommitError),
        ("io.delta.exceptions.MetadataChangedException", ConcurrentCommitError),
    ],
)
def test_delta_conflicts_are_raised_as_their_kind(
    spark: SparkSession, jvm_class: str, error: type[ConcurrentCommitError]
) -> None:
    with pytest.raises(ConcurrentCommitError) as raised, merge.typed_conflicts():
        thrower(spark, jvm_class, "[DELTA_CONCURRENT] lost the race\nConflicting commit: {}")()
    assert type(raised.value) is error
    assert str(raised.value) == "[DELTA_CONCURRENT] lost the race"
    # As the JVM exception, or as Delta's Python class once delta.tables is imported (it converts them).
    assert isinstance(raised.value.__cause__, (Py4JJavaError, CapturedException))


def test_any_other_compaction_error_is_raised(spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    # The message names a conflict; the class, which is what counts, is not one.
    _refuse(monkeypatch, thrower(spark, "java.lang.IllegalStateException", f"[DELTA_TABLE_NOT_FOUND] {DELETE_READ}"))
    with pytest.raises(Py4JJavaError, match="DELTA_TABLE_NOT_FOUND"):
        merge.compact_files(spark, Target(path="/r/orders"), 16 << 20)


@pytest.mark.parametrize(
    ("delta_class", "error"),
    [
        ("ConcurrentAppendException", ConcurrentAppendError),
        ("ConcurrentDeleteReadException", ConcurrentDeleteReadError),
        ("ConcurrentDeleteDeleteException", ConcurrentDeleteDeleteError),
        ("ConcurrentTransactionException", ConcurrentCommitError),
        ("MetadataChangedException", ConcurrentCommitError),
    ],
)
def test_conflicts_converted_by_delta_python_are_raised_as_their_kind(
    spark: SparkSession, delta_class: str, error: type[ConcurrentCommitError]
) -> None:
    # Importing delta.tables makes PySpark raise Delta's conflicts as these classes, built as Delta builds them.
    from delta.exceptions import captured

    converted = getattr(captured, delta_class)("[DELTA_CONCURRENT] lost the race\nConflicting commit", "at io...", None)
    with pytest.raises(ConcurrentCommitError) as raised, merge.typed_conflicts():
        raise converted
    assert type(raised.value) is error
    assert str(raised.value) == "[DELTA_CONCURRENT] lost the race"
    assert raised.value.__cause__ is converted


def test_a_compaction_turn_packs_only_the_tables_that_hold_files(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A quarantine nothing was sent to is empty: its OPTIMIZE would plan and run jobs for nothing, at every turn.
    empty, filled, absent = (Target(path=str(tmp_path / name)) for name in ("empty", "filled", "absent"))
    spark.sql(f"CREATE TABLE delta.`{empty.path}` (k BIGINT) USING delta")
    spark.range(3).withColumnRenamed("id", "k").write.format("delta").save(filled.path)
    packed: list[Target] = []

    def compact(_spark: SparkSession, target: Target, _small: int) -> merge.Compacted:
        packed.append(target)
        return merge.Compacted(2, 1)

    monkeypatch.setattr(batch, "compact_files", compact)
    line = batch._compact_all(spark, [empty, filled, absent], 16 << 20)
    assert packed == [filled]
    assert line == f"delta.`{filled.path}` 2 files into 1"
