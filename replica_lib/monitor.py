"""A replica's applied offsets in a Kafka consumer group of its own, so that standard Kafka tooling shows its lag.

Spark's kafka source commits nothing to Kafka: its offsets live in the checkpoint, and the applied ones in each
Delta commit. After every batch, the replica also commits its batch's end offsets to the consumer group
``replica-<name>`` (:func:`group_id`), so ``kafka-consumer-groups.sh --describe --group replica-<name>`` and any
lag exporter see how far it is. This is for monitoring only: recovery never reads these offsets, a failed commit
is a warning and never fails a batch, and the commits run on a thread of their own, off the batch's path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from replica_lib.config import ReplicaConfig

logger = logging.getLogger(__name__)

#: topic -> partition -> next offset to read (as in :mod:`replica_lib.progress`).
Offsets = Mapping[str, Mapping[int, int]]

#: How long :meth:`GroupOffsets.close` waits for the last commit, and one commit waits for the broker.
CLOSE_TIMEOUT_S = 10.0


def group_id(replica: str) -> str:
    """The consumer group that shows a replica's applied offsets to Kafka tooling."""
    return f"replica-{replica}"


class GroupOffsets:
    """Commits a replica's applied offsets to its consumer group, on a background thread.

    :meth:`publish` only hands the offsets over (a lock and an assignment); the thread commits the newest offsets
    handed over, skipping any that a newer batch replaced meanwhile. A Kafka client is made on first use. If the
    connection has no librdkafka equivalent (``KafkaConfig.client_config``), nothing is committed (one warning).
    """

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.group = group_id(cfg.name)
        client = cfg.kafka.client_config()
        self._settings = client.settings
        if self._settings is None:
            logger.warning(
                "replica %s: its applied offsets are not committed to consumer group %s (for Kafka tooling): %s",
                cfg.name,
                self.group,
                client.reason,
            )
        self._cond = threading.Condition()
        self._pending: Offsets | None = None
        self._busy = False
        self._closed = False
        self._failing = False
        self._thread: threading.Thread | None = None
        self._client: Any = None  # the Kafka consumer, made and used on the thread only
        #: The offsets last committed, for tests and logs.
        self.committed: Offsets | None = None

    def publish(self, offsets: Offsets) -> None:
        """Hand over a batch's end offsets; returns at once."""
        if self._settings is None or not offsets:
            return
        with self._cond:
            if self._closed:
                return
            self._pending = offsets
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.group}-offsets", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until the offsets handed over are committed (or failed); False if that took over ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout_s)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Commit what is pending (within ``timeout_s``), then stop the thread."""
        if not self.flush(timeout_s):
            logger.warning("consumer group %s: the last offsets were not committed within %.0fs", self.group, timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending is not None or self._closed)
                    if self._pending is None:
                        return  # closed, nothing left
                    offsets, self._pending, self._busy = self._pending, None, True
                try:
                    self._commit(offsets)
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        finally:
            if self._client is not None:
                self._client.close()

    def _consumer(self) -> Any:
        from confluent_kafka import Consumer

        assert self._settings is not None
        return Consumer(
            {
                **self._settings,
                "group.id": self.group,
                "enable.auto.commit": False,
                "socket.timeout.ms": int(CLOSE_TIMEOUT_S * 1000),
                "logger": logging.getLogger(f"{__name__}.librdkafka"),
            }
        )

    def _commit(self, offsets: Offsets) -> None:
        """Commit ``offsets`` as the group's (no subscription: the group has no members, only offsets)."""
        from confluent_kafka import KafkaException, TopicPartition

        partitions = [TopicPartition(t, p, o) for t, parts in offsets.items() for p, o in sorted(parts.items())]
        try:
            if self._client is None:
                self._client = self._consumer()
            results = self._client.commit(offsets=partitions, asynchronous=False)
            failed = [tp for tp in results or () if tp.error is not None]
            if failed:
                raise KafkaException(failed[0].error)
        except KafkaException as exc:
            # Warn when commits start failing, not on every batch while the broker stays away.
            log = logger.debug if self._failing else logger.warning
            log("consumer group %s: could not commit the applied offsets (monitoring only): %s", self.group, exc)
            self._failing = True
            return
        if self._failing:
            logger.info("consumer group %s: committing the applied offsets again", self.group)
        self._failing = False
        self.committed = offsets
