"""SQL access: each replica table as a temporary view named after the table."""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql import SparkSession

from replica_lib.config import ReplicaConfig
from replica_lib.errors import ConfigError
from replica_lib.layout import read_state
from replica_lib.target import read_table, table_exists


def register_views(spark: SparkSession, cfg: ReplicaConfig, versions: Mapping[str, int] | None = None) -> list[str]:
    """Register ``<table>`` for each replica table and ``<replica>_quarantine``; returns the view names.

    ``versions``: tables to read at a given Delta version (e.g. one that holds a write: :mod:`replica_lib.reads`);
    a merge-on-read table's view is its state (:mod:`replica_lib.layout`), its change log at that version.
    """
    names = []
    for table in cfg.tables:
        if not table_exists(spark, table.target):
            raise ConfigError(
                cfg.source_file,
                f"tables.{table.name}.target",
                f"no Delta table at {table.target.describe()} yet",
                "run the replica first: it creates its tables with its first batch",
            )
        version = (versions or {}).get(table.name)
        rows = read_state(spark, table, version) if table.merge_on_read else read_table(spark, table.target, version)
        rows.createOrReplaceTempView(table.name)
        names.append(table.name)
    if table_exists(spark, cfg.quarantine):
        read_table(spark, cfg.quarantine).createOrReplaceTempView(f"{cfg.name}_quarantine")
        names.append(f"{cfg.name}_quarantine")
    return names
