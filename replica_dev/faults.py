"""Crash windows for the fault harness: batch hooks that SIGKILL the job at a named point of a batch, or, for a
replica run in the harness's own process, raise there (the batch stops at the same point, leaving the same files)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass, field

from replica_lib.batch import FOLD_COMPACTION_POINT, HOOK_POINTS, BatchHooks
from replica_lib.errors import ConfigError
from replica_lib.layout import FOLD_POINTS

logger = logging.getLogger(__name__)

CRASH_POINTS = (*HOOK_POINTS, *FOLD_POINTS, FOLD_COMPACTION_POINT)
#: The crash windows a batch passes, per layout of its table (a merge-on-read table's batches append no
#: tombstones; the batches that fold it pass the fold's points, and its compaction runs beside them too).
WINDOWS = {
    "copy-on-write": HOOK_POINTS,
    "merge-on-read": (*(p for p in HOOK_POINTS if p != "after_tombstones"), *FOLD_POINTS, FOLD_COMPACTION_POINT),
}
#: The environment variable the fault harness sets on the job it launches (``jobs/dev/faulty_replica.py``).
CRASH_ENV = "REPLICA_CRASH_AT"


class InjectedCrash(Exception):
    """A crash window hit in the harness's own process: what the batch raises where a launched job is SIGKILLed."""


@dataclass(frozen=True)
class CrashPoint:
    """SIGKILL the job at ``point`` of a batch; ``batch_id`` None means the first batch with records.

    ``in_process``: raise :class:`InjectedCrash` instead, for a replica run in this process (its on-disk state at the
    point is the same; a SIGKILL would also end the harness). ``hit`` is set once the point was reached.
    """

    point: str
    batch_id: int | None = None
    in_process: bool = False
    hit: threading.Event = field(default_factory=threading.Event, compare=False)

    def hooks(self) -> BatchHooks:
        return BatchHooks(at=self._at)

    def _at(self, point: str, batch_id: int) -> None:
        if point != self.point or (self.batch_id is not None and self.batch_id != batch_id) or self.hit.is_set():
            return
        self.hit.set()
        logger.warning("batch %d: crashing at %s (%s)", batch_id, point, "in process" if self.in_process else CRASH_ENV)
        if self.in_process:
            raise InjectedCrash(f"batch {batch_id}: crashed at {point}")
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def crash_point(text: str | None) -> CrashPoint | None:
    """``point`` or ``point:batch_id`` (what the harness puts in ``REPLICA_CRASH_AT``); None for nothing."""
    if not text:
        return None
    point, _, batch = text.partition(":")
    if point not in CRASH_POINTS or (batch and not batch.isdigit()):
        raise ConfigError(
            "environment",
            CRASH_ENV,
            f"{text!r} is not a crash point",
            f"use one of {', '.join(CRASH_POINTS)}, optionally with :<batch id>, or unset it",
        )
    return CrashPoint(point, int(batch) if batch else None)
