"""Kafka -> raw rows: Spark's own kafka source, reading only committed records."""

from __future__ import annotations

import logging

from pyspark.sql import DataFrame, SparkSession

from replica_lib.config import ReplicaConfig

logger = logging.getLogger(__name__)


def source_options(cfg: ReplicaConfig, starting_offsets: str | None = None) -> dict[str, str]:
    """Options for ``spark.readStream.format("kafka")``; any ``kafka.*`` option of the config passes through."""
    options = cfg.kafka.spark_options()
    options.update({
        "subscribe": ",".join(cfg.topics),
        "startingOffsets": starting_offsets or cfg.source.starting_offsets,
        "failOnDataLoss": "true" if cfg.source.fail_on_data_loss else "false",
        # An aborted transaction is never applied; records above the last stable offset wait.
        "kafka.isolation.level": "read_committed",
        "groupIdPrefix": f"replica-{cfg.name}",
        "includeHeaders": "false",
    })  # fmt: skip
    if cfg.source.max_offsets_per_trigger:
        options["maxOffsetsPerTrigger"] = str(cfg.source.max_offsets_per_trigger)
    return options


def read_changes(spark: SparkSession, cfg: ReplicaConfig, starting_offsets: str | None = None) -> DataFrame:
    """The replica's topics as a stream of raw records (key, value, topic, partition, offset, timestamp)."""
    if not cfg.source.fail_on_data_loss:
        logger.warning(
            "replica %s: failOnDataLoss is OFF (%s, source.fail_on_data_loss = false): if the log loses "
            "records this replica has not read, it will SKIP them silently and diverge from the primary",
            cfg.name,
            cfg.source_file,
        )
    reader = spark.readStream.format("kafka")
    for key, value in source_options(cfg, starting_offsets).items():
        reader = reader.option(key, value)
    return reader.load().select("key", "value", "topic", "partition", "offset", "timestamp")
