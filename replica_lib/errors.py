"""Typed errors: one class per failure kind, each with a message that says what to do."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class ReplicaError(Exception):
    """Base class of every error raised by replica_lib."""


class ConfigError(ReplicaError):
    """A configuration file or argument is invalid; names the file, the key and the fix."""

    def __init__(self, source: str, key: str, problem: str, fix: str) -> None:
        self.source = source
        self.key = key
        self.problem = problem
        self.fix = fix
        super().__init__(f"{source}: {key}: {problem} (fix: {fix})")


class SetupError(ReplicaError):
    """The local environment cannot run replica (Java, artifacts, ports); says how to fix it."""


class BrokerError(ReplicaError):
    """The embedded Kafka broker failed to start, stop or answer."""


class ConnectError(ReplicaError):
    """The local Kafka Connect worker failed to start or answer, or a connector on it failed."""


class ProducerError(ReplicaError):
    """A change event could not be written to Kafka; nothing is ever dropped silently."""

    def __init__(self, message: str, topic: str | None = None, key: bytes | None = None) -> None:
        self.topic = topic
        self.key = key
        super().__init__(message)


class LateChangeError(ProducerError):
    """A change's seq is lower than one already written for its key: compaction would keep it (nothing written)."""


class TopicError(ReplicaError):
    """A topic could not be created, or exists with settings that do not match what was asked."""


class ReplicationFactorError(TopicError):
    """A topic asks for more copies than the cluster has brokers (e.g. replication factor 3 on one broker)."""

    def __init__(self, message: str, replication_factor: int, brokers: int) -> None:
        self.replication_factor = replication_factor
        self.brokers = brokers
        super().__init__(message)


class CheckpointError(ReplicaError):
    """A checkpoint cannot be used by this replica (it belongs to another replica, or is damaged)."""


class ChecksumError(CheckpointError):
    """A file of a checkpoint does not match the checksum that Hadoop's file system keeps beside it (``.NAME.crc``):
    it was changed by hand or damaged."""


class PartitionsChangedError(ReplicaError):
    """A topic gained partitions under a table ordered by log position, whose order then no longer holds."""


class KeyAcrossPartitionsError(PartitionsChangedError):
    """A key of a table ordered by log position has changes in two partitions, which the log cannot order."""


class DataLossError(ReplicaError):
    """The log no longer holds records this replica has not applied yet; says what is missing and how to rebuild."""


class TopicReplacedError(ReplicaError):
    """A topic was deleted and created again under its name since the replica applied offsets of it: those offsets
    name other records now; says how to rebuild from the new topic."""


class NotAppliedError(ReplicaError):
    """No replica applied a write within the time allowed; says how far each replica is from it."""


class RebuildError(ReplicaError):
    """A rebuild cannot run as asked (its folder holds another rebuild, its end cannot be known); says what to do."""


class VerifyError(ReplicaError):
    """Two tables cannot be compared (different keys, or recorded at different offsets); says how to compare them."""


class MaintenanceError(ReplicaError):
    """Maintenance could not finish a table (e.g. it kept conflicting with the running replica); says what to do."""


class ConcurrentCommitError(ReplicaError):
    """Delta refused a commit because another commit on the same table won the race; the write may run again.

    Delta's ``DeltaConcurrentModificationException`` and its kinds, as the project's own types whichever way they
    reach Python (see :func:`replica_lib.merge.delta_conflict`), so callers catch them with the other errors here.
    """


class ConcurrentAppendError(ConcurrentCommitError):
    """Files were added to what the refused commit had read (Delta's ``ConcurrentAppendException``)."""


class ConcurrentDeleteReadError(ConcurrentCommitError):
    """A file the refused commit had read was removed, e.g. by an OPTIMIZE (``ConcurrentDeleteReadException``)."""


class ConcurrentDeleteDeleteError(ConcurrentCommitError):
    """Both commits removed the same file (Delta's ``ConcurrentDeleteDeleteException``)."""


class CatalogError(ReplicaError):
    """A catalog name cannot be registered as asked (a name of someone else's, the local catalog held); says what
    to do."""


def jvm_causes(exc: BaseException) -> Iterator[Any]:
    """The JVM exception a PySpark error holds (a ``Py4JJavaError``'s, a ``CapturedException``'s), then its causes.

    A failure is told by these objects' classes and Spark's error conditions, never by the text of its message.
    """
    from py4j.protocol import Py4JJavaError
    from pyspark import SparkContext
    from pyspark.errors.exceptions.captured import CapturedException

    cause = None
    if isinstance(exc, Py4JJavaError):
        cause = exc.java_exception
    elif isinstance(exc, CapturedException):
        cause = getattr(exc, "_origin", None)
    while cause is not None and SparkContext._gateway is not None:
        yield cause
        cause = cause.getCause()


def jvm_condition(gateway: Any, cause: Any) -> str | None:
    """Spark's error condition of a JVM exception (``KAFKA_DATA_LOSS.START_OFFSET_RESET``), if it has one."""
    from py4j.java_gateway import is_instance_of

    if not is_instance_of(gateway, cause, "org.apache.spark.SparkThrowable"):
        return None
    condition = cause.getCondition()
    return str(condition) if condition is not None else None
