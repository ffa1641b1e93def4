"""Replica topics: create them with safe settings, and say plainly when an existing one is unsafe.

A replica topic is a replication log: it must survive a broker loss (replication factor >= 3 with
``min.insync.replicas`` = 2 under ``acks=all``) and must keep enough history to rebuild a replica by replay
(``cleanup.policy=compact`` keeps the latest record per key forever, and delete tombstones for
``delete.retention.ms``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from replica_lib.errors import ReplicationFactorError, TopicError

logger = logging.getLogger(__name__)

DAY_MS = 86_400_000
Level = Literal["unsafe", "mismatch", "note"]


@dataclass(frozen=True)
class TopicSpec:
    """What a replica topic should look like."""

    name: str
    partitions: int = 6
    replication_factor: int = 3
    min_insync_replicas: int = 2
    compact: bool = True
    delete_retention_ms: int = 7 * DAY_MS
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a topic needs a name")
        if self.partitions < 1 or self.replication_factor < 1 or self.min_insync_replicas < 1:
            raise ValueError("partitions, replication_factor and min_insync_replicas must be >= 1")
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError("min_insync_replicas cannot exceed replication_factor: every acks=all write would fail")

    @classmethod
    def local(cls, name: str, partitions: int = 3, **kwargs: object) -> TopicSpec:
        """A topic for the single-node embedded broker (replication factor 1)."""
        return cls(name=name, partitions=partitions, replication_factor=1, min_insync_replicas=1, **kwargs)  # type: ignore[arg-type]

    def configs(self) -> dict[str, str]:
        conf = {
            "cleanup.policy": "compact" if self.compact else "delete",
            "min.insync.replicas": str(self.min_insync_replicas),
            "delete.retention.ms": str(self.delete_retention_ms),
            "unclean.leader.election.enable": "false",
        }
        if not self.compact:
            conf["retention.ms"] = "-1"  # a delete-policy log must keep everything to stay rebuildable
        conf.update(dict(self.extra))
        return conf


@dataclass(frozen=True)
class Finding:
    """One thing wrong with (or worth knowing about) a topic, with the fix."""

    level: Level
    setting: str
    message: str

    def __str__(self) -> str:
        return f"[{self.level}] {self.setting}: {self.message}"


@dataclass(frozen=True)
class TopicReport:
    name: str
    created: bool
    partitions: int
    replication_factor: int
    configs: Mapping[str, str]
    findings: tuple[Finding, ...]

    @property
    def unsafe(self) -> bool:
        return any(f.level in ("unsafe", "mismatch") for f in self.findings)


def assess(
    partitions: int,
    replication_factor: int,
    configs: Mapping[str, str],
    expected: TopicSpec | None,
    local: bool,
) -> tuple[Finding, ...]:
    """Judge a topic's settings for use as a replication log (pure: no broker needed)."""
    return (
        *_durability(replication_factor, configs, local),
        *_retention(configs),
        *_leader_election(configs),
        *([] if expected is None else _mismatches(partitions, replication_factor, configs, expected)),
    )


def _durability(replication_factor: int, configs: Mapping[str, str], local: bool) -> list[Finding]:
    """Whether an acknowledged change survives the loss of a broker."""
    findings: list[Finding] = []
    min_isr = int(configs.get("min.insync.replicas", "1"))
    if replication_factor < 3:
        if local:
            findings.append(
                Finding("note", "replication.factor", f"{replication_factor}: fine for the local sandbox only")
            )
        else:
            findings.append(
                Finding(
                    "unsafe",
                    "replication.factor",
                    f"{replication_factor}: losing one broker can lose acknowledged changes; "
                    "use 3 (recreate the topic or reassign its partitions)",
                )
            )
    if replication_factor >= 3 and min_isr < 2:
        findings.append(
            Finding(
                "unsafe", "min.insync.replicas", f"{min_isr}: acks=all is then satisfied by a single copy; set it to 2"
            )
        )
    return findings


def _leader_election(configs: Mapping[str, str]) -> list[Finding]:
    """Whether an out-of-sync copy may become leader (and drop acknowledged changes)."""
    if configs.get("unclean.leader.election.enable", "false") != "true":
        return []
    return [
        Finding(
            "unsafe",
            "unclean.leader.election.enable",
            "true: an out-of-sync replica can become leader and drop acknowledged changes; set it to false",
        )
    ]


def _retention(configs: Mapping[str, str]) -> list[Finding]:
    """Whether the log keeps every key's latest change (and its tombstones long enough) for a rebuild by replay."""
    findings: list[Finding] = []
    policy = set(configs.get("cleanup.policy", "delete").replace(" ", "").split(","))
    retention_ms = int(configs.get("retention.ms", str(7 * DAY_MS)))
    delete_retention_ms = int(configs.get("delete.retention.ms", str(DAY_MS)))
    if "compact" not in policy:
        if retention_ms >= 0:
            days = retention_ms / DAY_MS
            findings.append(
                Finding(
                    "unsafe",
                    "cleanup.policy",
                    f"delete with retention.ms={retention_ms} ({days:g} days): changes older than "
                    "that are gone, so a replica cannot be rebuilt by replay; use "
                    "cleanup.policy=compact",
                )
            )
    elif "delete" in policy and retention_ms >= 0:
        findings.append(
            Finding(
                "unsafe",
                "cleanup.policy",
                f"compact,delete with retention.ms={retention_ms}: keys not written within the "
                "retention are deleted, so a rebuild misses them; use compact alone",
            )
        )
    if "compact" in policy and delete_retention_ms < DAY_MS:
        findings.append(
            Finding(
                "unsafe",
                "delete.retention.ms",
                f"{delete_retention_ms} ms: tombstones vanish sooner than a day, so a replica "
                "that is down longer misses deletes; set it above your longest outage",
            )
        )
    return findings


def _mismatches(
    partitions: int, replication_factor: int, configs: Mapping[str, str], expected: TopicSpec
) -> list[Finding]:
    """Where the topic differs from what the project would have created."""
    findings: list[Finding] = []
    if partitions != expected.partitions:
        findings.append(
            Finding(
                "mismatch",
                "partitions",
                f"{partitions}, expected {expected.partitions}: partition count decides which "
                "partition a key lives in; changing it re-keys the log",
            )
        )
    if replication_factor != expected.replication_factor:
        findings.append(
            Finding("mismatch", "replication.factor", f"{replication_factor}, expected {expected.replication_factor}")
        )
    for key, want in expected.configs().items():
        have = configs.get(key)
        if have is not None and have != want:
            findings.append(Finding("mismatch", key, f"{have}, expected {want}"))
    return findings


class _Backoff:
    """Polling the broker for what it cannot announce (a new topic's metadata, its partitions' leaders): waits of
    20 ms doubling up to 0.5 s between polls, until a deadline."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s
        self._delay = 0.02

    def left(self) -> float:
        """Seconds to the deadline (at least 0.1: a request needs some time)."""
        return max(0.1, self._deadline - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self._deadline

    def wait(self) -> None:
        time.sleep(self._delay)  # back off between polls; the deadline bounds the wait
        self._delay = min(self._delay * 2, 0.5)


class TopicAdmin:
    """Creates and validates replica topics with confluent-kafka's AdminClient."""

    def __init__(self, connection: Mapping[str, str], timeout_s: float = 15.0) -> None:
        from confluent_kafka.admin import AdminClient

        self.timeout_s = timeout_s
        self._bootstrap = connection.get("bootstrap.servers", "")
        # To librdkafka the admin client is a producer, whose metadata requests by default create a missing
        # topic (with the broker's unsafe defaults) on brokers that allow auto-creation.
        conf: dict[str, Any] = {
            **connection,
            "allow.auto.create.topics": False,
            "logger": logging.getLogger(f"{__name__}.librdkafka"),
        }
        self._admin = AdminClient(conf)
        try:
            self._admin.list_topics(timeout=timeout_s)
        except Exception as exc:
            raise TopicError(
                f"cannot reach Kafka at {self._bootstrap} within {timeout_s:.0f}s ({exc}): check bootstrap "
                "servers and that the brokers are up"
            ) from exc

    def describe(self, name: str) -> tuple[int, int, dict[str, str]] | None:
        """(partitions, replication factor, configs) of ``name``, or None if it does not exist."""
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import ConfigResource, ResourceType

        try:
            metadata = self._admin.list_topics(topic=name, timeout=self.timeout_s)
            info = metadata.topics.get(name)
            if info is None or info.error is not None:
                return None
            partitions = len(info.partitions)
            replication = min((len(p.replicas) for p in info.partitions.values()), default=0)
            resource = ConfigResource(ResourceType.TOPIC, name)
            entries = self._admin.describe_configs([resource])[resource].result(timeout=self.timeout_s)
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                return None
            raise TopicError(f"describing topic {name!r} on {self._bootstrap} failed: {error.str()}") from exc
        configs = {key: entry.value for key, entry in entries.items() if entry.value is not None}
        return partitions, replication, configs

    def _describe_created(self, name: str) -> tuple[int, int, dict[str, str]]:
        """Describe a topic that was just created: metadata can lag creation, so poll until it shows."""
        backoff = _Backoff(self.timeout_s)
        while True:
            described = self.describe(name)
            if described is not None:
                return described
            if backoff.expired():
                raise TopicError(
                    f"topic {name!r} was created on {self._bootstrap} but its metadata did not "
                    f"show it within {self.timeout_s:.0f}s"
                )
            backoff.wait()

    def validate(self, name: str, expected: TopicSpec | None = None, local: bool = False) -> TopicReport:
        """Report on an existing topic; raises :class:`TopicError` if it does not exist."""
        described = self.describe(name)
        if described is None:
            raise TopicError(f"topic {name!r} does not exist on {self._bootstrap}: create it first (TopicAdmin.ensure)")
        partitions, replication, configs = described
        findings = assess(partitions, replication, configs, expected, local)
        return TopicReport(name, False, partitions, replication, configs, findings)

    def ensure(self, spec: TopicSpec, local: bool = False) -> TopicReport:
        """Create ``spec`` if it is missing, then validate it against ``spec``."""
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import NewTopic

        created = fresh = False  # fresh: created by this call or by another one just now
        if self.describe(spec.name) is None:
            topic = NewTopic(
                spec.name,
                num_partitions=spec.partitions,
                replication_factor=spec.replication_factor,
                config=spec.configs(),
            )
            try:
                self._admin.create_topics([topic], operation_timeout=self.timeout_s)[spec.name].result(
                    timeout=self.timeout_s
                )
                created = fresh = True
                logger.info(
                    "created topic %s (%d partitions, rf %d)", spec.name, spec.partitions, spec.replication_factor
                )
            except KafkaException as exc:
                error = exc.args[0]
                if error.code() == KafkaError.INVALID_REPLICATION_FACTOR:
                    brokers = len(self._admin.list_topics(timeout=self.timeout_s).brokers)
                    raise ReplicationFactorError(
                        f"creating topic {spec.name!r} failed: replication factor {spec.replication_factor} needs "
                        f"{spec.replication_factor} brokers and {self._bootstrap} has {brokers}: add brokers or "
                        "lower the replication factor",
                        spec.replication_factor,
                        brokers,
                    ) from exc
                if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise TopicError(f"creating topic {spec.name!r} failed: {error.str()}") from exc
                fresh = True
        partitions, replication, configs = self._describe_created(spec.name)
        if fresh:
            self._await_leaders(spec.name, partitions)
        findings = assess(partitions, replication, configs, spec, local)
        return TopicReport(spec.name, created, partitions, replication, configs, findings)

    def _await_leaders(self, name: str, partitions: int) -> None:
        """Return once every partition of a topic just created answers its leader's offset request.

        Until then the broker refuses writes to a partition, and an idempotent librdkafka producer whose later
        write to it is taken first (a new partition takes any first sequence number) reports the refused ones as
        acknowledged, without offsets, and never sends them again: they are lost.
        """
        from confluent_kafka import KafkaError, KafkaException, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        # What a partition answers until its leader is ready (Kafka's own clients retry these: its leader epoch not
        # yet known to the broker asked, UNKNOWN_LEADER_EPOCH, failed 1 of 4 runs of the topics tests under load), and
        # what the client says until its metadata shows the topic's partitions (_NOENT, seen here in 2 of 3 requests
        # just after creation) or while a connection is re-established; other errors end the wait.
        not_yet = {
            KafkaError._NOENT,
            KafkaError.LEADER_NOT_AVAILABLE,
            KafkaError.NOT_LEADER_FOR_PARTITION,
            KafkaError.UNKNOWN_TOPIC_OR_PART,
            KafkaError._UNKNOWN_PARTITION,
            KafkaError.FENCED_LEADER_EPOCH,
            KafkaError.UNKNOWN_LEADER_EPOCH,
            KafkaError.OFFSET_NOT_AVAILABLE,
            KafkaError._TIMED_OUT,
            KafkaError.REQUEST_TIMED_OUT,
            KafkaError.NETWORK_EXCEPTION,
            KafkaError._TRANSPORT,
        }
        backoff = _Backoff(self.timeout_s)
        waiting = set(range(partitions))
        while True:
            left = backoff.left()
            request = {TopicPartition(name, p): OffsetSpec.latest() for p in sorted(waiting)}  # type: ignore[no-untyped-call]
            futures = self._admin.list_offsets(request, request_timeout=left)
            last = ""
            for tp, future in futures.items():
                try:
                    future.result(timeout=left + 5)  # librdkafka's own timeout answers first
                    waiting.discard(tp.partition)
                except KafkaException as exc:
                    error = exc.args[0]
                    if error.code() not in not_yet and not error.retriable():
                        raise TopicError(
                            f"topic {name!r} was created on {self._bootstrap} but partition {tp.partition} refused "
                            f"its offsets: {error.str()}"
                        ) from exc
                    last = error.str()
                except (TimeoutError, RuntimeError) as exc:  # no answer in time, or the request as a whole failed
                    last = str(exc)
            if not waiting:
                return
            if backoff.expired():
                raise TopicError(
                    f"topic {name!r} was created on {self._bootstrap} but {len(waiting)} of its {partitions} "
                    f"partitions had no leader within {self.timeout_s:.0f}s ({last}): check the brokers' logs"
                )
            backoff.wait()

    def delete(self, name: str) -> None:
        """Delete a topic (tests and the sandbox only)."""
        from confluent_kafka import KafkaException

        future = self._admin.delete_topics([name], operation_timeout=self.timeout_s)[name]
        try:
            future.result(timeout=self.timeout_s)
        except KafkaException as exc:
            raise TopicError(f"deleting topic {name!r} failed: {exc.args[0].str()}") from exc

    def topic_ids(self, names: list[str]) -> dict[str, str]:
        """The id of each of ``names`` that exists (Kafka's UUID for a topic: a topic deleted and created again under
        its name has a new one)."""
        from confluent_kafka import KafkaError, KafkaException, TopicCollection

        ids = {}
        futures = self._admin.describe_topics(TopicCollection(names), request_timeout=self.timeout_s)
        for name, future in futures.items():
            try:
                ids[name] = str(future.result(timeout=self.timeout_s).topic_id)
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    continue
                raise TopicError(f"describing topic {name!r} on {self._bootstrap} failed: {exc.args[0].str()}") from exc
        return ids

    def earliest_offsets(self, name: str) -> dict[int, int]:
        """The log start offset of every partition of ``name`` (what retention has not yet removed)."""
        from confluent_kafka import TopicPartition
        from confluent_kafka.admin import OffsetSpec

        described = self.describe(name)
        if described is None:
            raise TopicError(f"topic {name!r} does not exist on {self._bootstrap}")
        request = {TopicPartition(name, p): OffsetSpec.earliest() for p in range(described[0])}  # type: ignore[no-untyped-call]
        try:
            futures = self._admin.list_offsets(request, request_timeout=self.timeout_s)
            return {tp.partition: future.result(timeout=self.timeout_s).offset for tp, future in futures.items()}
        except Exception as exc:
            raise TopicError(f"listing the earliest offsets of {name!r} failed: {exc}") from exc

    def latest_offsets(self, name: str) -> dict[int, int]:
        """The end of every partition of ``name`` as a ``read_committed`` reader sees it (the last stable offset).

        That is where a replica's batches end: records of open transactions are not yet readable, and a
        transaction's commit marker takes an offset that the batch after it covers.
        """
        from confluent_kafka import IsolationLevel, TopicPartition
        from confluent_kafka.admin import OffsetSpec

        described = self.describe(name)
        if described is None:
            raise TopicError(f"topic {name!r} does not exist on {self._bootstrap}")
        request = {TopicPartition(name, p): OffsetSpec.latest() for p in range(described[0])}  # type: ignore[no-untyped-call]
        try:
            futures = self._admin.list_offsets(
                request, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=self.timeout_s
            )
            return {tp.partition: future.result(timeout=self.timeout_s).offset for tp, future in futures.items()}
        except Exception as exc:
            raise TopicError(f"listing the latest offsets of {name!r} failed: {exc}") from exc

    def delete_records_before(self, name: str, offsets: Mapping[int, int]) -> None:
        """Advance the log start of each partition to ``offsets[partition]`` (what retention does; tests)."""
        from confluent_kafka import TopicPartition

        request = [TopicPartition(name, partition, offset) for partition, offset in offsets.items()]
        try:
            for future in self._admin.delete_records(request, request_timeout=self.timeout_s).values():
                future.result(timeout=self.timeout_s)
        except Exception as exc:
            raise TopicError(f"deleting records of {name!r} failed: {exc}") from exc
