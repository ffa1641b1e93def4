"""The benchmark's peer: kafka2delta 2.0.0 (PyPI), fed the records it is written for, driven like the others.

kafka2delta reads Debezium change events in Confluent's Avro wire format (``0x00``, a 4-byte big-endian schema
id, Avro binary) for key and value, the value flattened by ``ExtractNewRecordState`` with ``__deleted`` and
``__log_sequence_number``, and applies each micro-batch with its ``merge_micro_batch`` (one MERGE for upserts,
one for deletes). Its own ``stream_to_delta`` has no ``maxOffsetsPerTrigger`` and no available-now trigger, so
this module reads Kafka with the same source options as every other contender, selects exactly the columns
``stream_to_delta`` selects, and hands each batch to ``merge_micro_batch``.

It fetches schemas from a Confluent Schema Registry (``GET /schemas/ids/{id}``). None can be installed here
(not on PyPI or Maven Central), so :class:`Peer` serves that one endpoint itself, from a thread on 127.0.0.1,
with the two fixed schemas the records carry.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from replica_dev.bench import DATA_COLUMNS, Event
from replica_dev.maven import SPARK_AVRO
from replica_lib.errors import SetupError

if TYPE_CHECKING:
    from replica_dev.bench import Bench

logger = logging.getLogger(__name__)

PEER_VERSION = "2.0.0"
KEY_SCHEMA_ID = 1
VALUE_SCHEMA_ID = 2
LSN_COLUMN = "__log_sequence_number"
DELETED_COLUMN = "__deleted"
_NAMESPACE = "replica.bench.orders"
#: The key: the primary key, as Debezium writes it.
KEY_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Key",
    "namespace": _NAMESPACE,
    "fields": [{"name": "order_id", "type": "long"}],
}
#: The value: the row after the change (``ExtractNewRecordState``, ``delete.handling.mode=rewrite``, with the
#: ``lsn`` source field added as ``__log_sequence_number``); every column but the key is an optional union.
VALUE_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Value",
    "namespace": _NAMESPACE,
    "fields": [
        {"name": "order_id", "type": "long"},
        *(
            {"name": name, "type": ["null", avro_type], "default": None}
            for name, avro_type in (
                ("customer", "string"),
                ("amount", "double"),
                ("status", "string"),
                ("updated_ms", "long"),
                ("note", "string"),
                (DELETED_COLUMN, "string"),
                (LSN_COLUMN, "long"),
            )
        ),
    ],
}
SCHEMAS: dict[int, dict[str, Any]] = {KEY_SCHEMA_ID: KEY_SCHEMA, VALUE_SCHEMA_ID: VALUE_SCHEMA}


# ---------------------------------------------------------------------------------------------- Avro
def _long(n: int) -> bytes:
    """Avro ``long``: zigzag, then a little-endian base-128 varint."""
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _string(text: str) -> bytes:
    data = text.encode()
    return _long(len(data)) + data


_NULL = b"\x00"  # union branch 0 ("null")
_SOME = b"\x02"  # union branch 1, zigzag-encoded
_DOUBLE = struct.Struct("<d")
_KEY_FRAME = b"\x00" + struct.pack(">I", KEY_SCHEMA_ID)
_VALUE_FRAME = b"\x00" + struct.pack(">I", VALUE_SCHEMA_ID)
_FALSE = _SOME + _string("false")
_TRUE = _SOME + _string("true")


def _opt_string(value: str | None) -> bytes:
    return _NULL if value is None else _SOME + _string(value)


def _opt_long(value: int | None) -> bytes:
    return _NULL if value is None else _SOME + _long(value)


def _opt_double(value: float | None) -> bytes:
    return _NULL if value is None else _SOME + _DOUBLE.pack(value)


def encode_record(event: Event) -> tuple[bytes, bytes]:
    """``event`` as a Kafka key and value in Confluent's Avro wire format (:data:`KEY_SCHEMA`, :data:`VALUE_SCHEMA`)."""
    key = _long(event.key)
    row = event.row
    if event.op == "delete" or row is None:
        data = key + _NULL * 5 + _TRUE
    else:
        data = (
            key
            + _opt_string(row["customer"])
            + _opt_double(row["amount"])
            + _opt_string(row["status"])
            + _opt_long(row["updated_ms"])
            + _opt_string(row["note"])
            + _FALSE
        )
    return _KEY_FRAME + key, _VALUE_FRAME + data + _SOME + _long(event.seq)


# ---------------------------------------------------------------------------------------------- the registry
class _RegistryHandler(BaseHTTPRequestHandler):
    """``GET /schemas/ids/{id}`` as Confluent Schema Registry answers it; 404 (code 40403) for anything else."""

    def do_GET(self) -> None:
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        schema = None
        body: dict[str, Any]
        if len(parts) == 3 and parts[:2] == ["schemas", "ids"] and parts[2].isdigit():
            schema = SCHEMAS.get(int(parts[2]))
        if schema is not None:
            status, body = 200, {"schema": json.dumps(schema)}  # no "schemaType": AVRO, as the registry does
        else:
            status, body = 404, {"error_code": 40403, "message": f"Schema not found: {self.path}"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("schema registry endpoint: " + format, *args)


def start_registry() -> ThreadingHTTPServer:
    """Serve the schemas on a free port of 127.0.0.1 from a daemon thread (it ends with the process)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RegistryHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="bench-peer-registry", daemon=True).start()
    return server


# ---------------------------------------------------------------------------------------------- the peer
class Peer:
    """kafka2delta as a benchmark contender: its record format, its tables, its per-batch MERGEs."""

    def __init__(self, version: str, registry: ThreadingHTTPServer) -> None:
        self.version = version
        self.registry = registry
        self.registry_url = f"http://127.0.0.1:{registry.server_address[1]}"

    @classmethod
    def load(cls) -> Peer:
        """Import kafka2delta and what it needs, check Spark has spark-avro, start the registry endpoint."""
        try:
            import confluent_kafka.schema_registry  # noqa: F401  (kafka2delta imports it per batch)
            import kafka2delta
            import kafka2delta.stream.stream
        except ImportError as exc:
            raise SetupError(
                f"the benchmark's peer cannot run: {exc}. kafka2delta and the schema-registry client are installed "
                "by scripts/bootstrap.sh from requirements-peer.txt (pip install --no-deps -r requirements-peer.txt); "
                "or leave 'peer' out of --contenders"
            ) from exc
        version = str(getattr(kafka2delta, "__version__", "unknown"))
        if version != PEER_VERSION:
            logger.warning("kafka2delta %s installed, the benchmark was written for %s", version, PEER_VERSION)
        spark = SparkSession.getActiveSession()
        if spark is not None and not _has_spark_avro(spark):
            raise SetupError(
                f"the benchmark's peer decodes with Spark's from_avro, and this Spark has no {SPARK_AVRO}: run the "
                "benchmark through ./spark-submit.sh jobs/bench.py (it adds the package), or pass "
                f"--packages {SPARK_AVRO}; or leave 'peer' out of --contenders"
            )
        try:
            registry = start_registry()
        except OSError as exc:
            raise SetupError(f"the peer's schema registry endpoint cannot listen on 127.0.0.1 ({exc})") from exc
        # The schema-registry client logs each request at INFO (two per batch): keep the bench's log readable.
        logging.getLogger("httpx2").setLevel(logging.WARNING)
        peer = cls(version, registry)
        logger.info("peer: kafka2delta %s, schema registry endpoint %s", version, peer.registry_url)
        return peer

    def describe(self) -> dict[str, Any]:
        """What the peer is and how it is run, for the report."""
        return {
            "name": "kafka2delta",
            "version": self.version,
            "source": "PyPI kafka2delta (installed with --no-deps from requirements-peer.txt)",
            "message_format": (
                "Confluent Avro wire format (0x00 + 4-byte schema id + Avro binary) for key and value; value = "
                "Debezium ExtractNewRecordState row with __deleted ('true'/'false') and __log_sequence_number "
                "(= the event's seq); a delete is __deleted='true' with the key and nulls, no tombstones"
            ),
            "schema_registry": (
                f"not a Confluent Schema Registry: an HTTP endpoint in the benchmark process ({self.registry_url}) "
                "answering GET /schemas/ids/{id} with the two fixed schemas, the only call kafka2delta makes; "
                "no registry (Confluent, Karapace, Apicurio) can be installed here from PyPI or Maven Central"
            ),
            "driver": (
                "kafka2delta.stream.stream.merge_micro_batch as foreachBatch on Spark's kafka source with the same "
                "options as the other contenders (stream_to_delta has no maxOffsetsPerTrigger or available-now)"
            ),
            "spark_package": SPARK_AVRO,
            "semantics": [
                "latest change per key in a batch by __log_sequence_number (window + row_number)",
                "updates applied only if newer than the row (LSN-gated); inserts of new keys not gated",
                "deletes not LSN-gated: a delete removes the row whatever its LSN; no tombstone kept, so a late "
                "older upsert re-inserts a deleted key",
                "Kafka tombstones (null values) are not supported (the batch fails)",
            ],
            "costs": [
                "three row-at-a-time Python UDFs per record (key and value schema id, Avro payload)",
                "two MERGEs per batch and schema pair (upserts, then deletes), each joining the batch with the whole "
                "table (the ON clause is the key equality only)",
                "the batch is cached; two schema-registry lookups per batch (a new client each time)",
            ],
        }

    def record(self, event: Event) -> tuple[bytes, bytes | None]:
        """The Kafka key and value of ``event`` in the peer's format."""
        return encode_record(event)

    def start(
        self,
        spark: SparkSession,
        bench: Bench,
        topic: str,
        base: Path,
        batch_size: int | None,
        once: bool,
        prefill: int,
    ) -> StreamingQuery:
        """Run kafka2delta on ``topic`` into ``base/table`` with a new checkpoint ``base/checkpoint``."""
        from kafka2delta.config import DeltaTableConfig
        from kafka2delta.stream.stream import merge_micro_batch

        path = base / "table"
        # kafka2delta names a temp view after the topic; the catalog table needs another name, unique per run.
        name = f"k2d_{base.name}_{uuid.uuid4().hex[:8]}".replace("-", "_").replace(".", "_")
        table = DeltaTableConfig(schema="default", table_name=name, path=str(path))
        if prefill:
            bench.prefill("peer", str(path), prefill, topic)
            # kafka2delta creates its table with saveAsTable unless the catalog already has it.
            spark.sql(f"CREATE TABLE IF NOT EXISTS {table.qualified_name} USING delta LOCATION '{path}'")

        # kafka2delta defines its UDFs when imported, which needs the session. They run pickled: it does not
        # depend on pandas or pyarrow, and neither is installed, so Spark's Arrow-optimized Python UDFs (on by
        # default in Spark 4.2) would fall back with a RuntimeWarning per run; asking for the plain UDF says so.
        arrow_udfs = "spark.sql.execution.pythonUDF.arrow.enabled"
        before = spark.conf.get(arrow_udfs)
        spark.conf.set(arrow_udfs, "false")
        try:
            from kafka2delta.udf import get_confluent_avro_value, get_schema_id
        finally:
            if before is None:
                spark.conf.unset(arrow_udfs)
            else:
                spark.conf.set(arrow_udfs, before)

        records = (
            spark.readStream.format("kafka")
            .options(**bench.source_options(topic, batch_size))
            .load()
            .select(
                "topic",
                "partition",
                "offset",
                "timestamp",
                "timestampType",
                get_schema_id("key").alias("key_schema_id"),
                get_schema_id("value").alias("value_schema_id"),
                get_confluent_avro_value("value").alias("value_avro"),
            )
        )
        handler = merge_micro_batch(schema_registry_url=self.registry_url, delta_table_configs={topic: table})
        writer = (
            records.writeStream.queryName(base.name)
            .option("checkpointLocation", str(base / "checkpoint"))
            .outputMode("update")
            .foreachBatch(handler)
        )
        writer = writer.trigger(availableNow=True) if once else writer.trigger(processingTime="0 seconds")
        return writer.start()

    def prefill_frame(self, df: DataFrame) -> DataFrame:
        """The bench's prefill rows in the shape kafka2delta creates: the value's columns but ``__deleted``."""
        return df.select(*DATA_COLUMNS, F.lit(0).cast("long").alias(LSN_COLUMN))


def _has_spark_avro(spark: SparkSession) -> bool:
    """Whether the JVM can load Spark's Avro functions (what ``pyspark.sql.avro.functions.from_avro`` calls)."""
    from py4j.java_gateway import JavaClass

    jvm = spark.sparkContext._jvm
    return jvm is not None and isinstance(jvm.org.apache.spark.sql.avro.functions, JavaClass)
