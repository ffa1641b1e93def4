"""The replica's compaction gives way to a concurrent commit (a warning, packed next time) and to nothing else."""

from __future__ import annotations

import logging

import pytest
from pyspark.sql import SparkSession

from replica_lib import merge
from replica_lib.config import Target

CONFLICT = "io.delta.exceptions.ConcurrentDeleteReadException: [DELTA_CONCURRENT_DELETE_READ] This transaction"
MIN_FILE_SIZE = "spark.databricks.delta.optimize.minFileSize"


class _Refusing:
    """A table whose OPTIMIZE fails with ``message``."""

    def __init__(self, message: str) -> None:
        self.message = message

    def optimize(self) -> None:
        raise RuntimeError(self.message)


def test_a_compaction_a_concurrent_commit_won_is_left_for_the_next(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = spark.conf.get(MIN_FILE_SIZE, None)
    monkeypatch.setattr(merge, "delta_table", lambda _spark, _target: _Refusing(CONFLICT))
    with caplog.at_level(logging.WARNING, logger="replica_lib.merge"):
        assert merge.compact_files(spark, Target(path="/r/orders"), 16 << 20) is None
    assert "compacting delta.`/r/orders`: a concurrent commit won, packed at the next compaction" in caplog.text
    assert spark.conf.get(MIN_FILE_SIZE, None) == before  # the session's OPTIMIZE settings are restored


def test_any_other_compaction_error_is_raised(spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge, "delta_table", lambda _spark, _target: _Refusing("[DELTA_TABLE_NOT_FOUND] no table"))
    with pytest.raises(RuntimeError, match="DELTA_TABLE_NOT_FOUND"):
        merge.compact_files(spark, Target(path="/r/orders"), 16 << 20)
