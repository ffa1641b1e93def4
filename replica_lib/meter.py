"""A progress meter for long Spark work (a rebuild): records read of the total, rate and time left.

Spark reports progress by task, not by record. The work's first stage reads the log in tasks of about equal size
(the Kafka read is split with ``minPartitions``), so its finished tasks say how many of the records are read;
later stages (ordering, writing) are shown by name and task count. In a terminal the meter is one line that
updates in place; otherwise it logs a line every :data:`LOG_EVERY_S` seconds.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

from pyspark.sql import SparkSession

logger = logging.getLogger(__name__)

#: Seconds between two log lines when the output is not a terminal (and between two terminal updates: 1).
LOG_EVERY_S = 10.0
TTY_EVERY_S = 1.0


@dataclass(frozen=True)
class Reading:
    """Where the work stands: tasks of the reading stage done of all, and the stage running after it, if any."""

    read_tasks_done: int
    read_tasks: int
    later_stage: str | None = None


def line(label: str, total: int, reading: Reading | None, elapsed_s: float) -> str:
    """The meter's text for ``reading`` after ``elapsed_s`` seconds."""
    if reading is None or reading.read_tasks == 0:
        return f"{label}: starting, {total:,} records to read"
    if reading.later_stage is not None:
        return f"{label}: read {total:,} records; {reading.later_stage}"
    done = total * reading.read_tasks_done // reading.read_tasks
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    left = f", {(total - done) / rate:,.0f} s left" if rate > 0 else ""
    return f"{label}: read {done:,} of {total:,} records ({100 * done // max(total, 1)}%), {rate:,.0f}/s{left}"


class _Poller(threading.Thread):
    def __init__(self, spark: SparkSession, group: str, label: str, total: int, out: TextIO) -> None:
        super().__init__(name=f"meter-{group}", daemon=True)
        self.tracker = spark.sparkContext.statusTracker()
        self.group, self.label, self.total, self.out = group, label, total, out
        self.tty = out.isatty()
        self.stopped = threading.Event()
        self.started = time.monotonic()
        self.width = 0

    def reading(self) -> Reading | None:
        stages = []
        for job_id in sorted(self.tracker.getJobIdsForGroup(self.group)):
            job = self.tracker.getJobInfo(job_id)
            for stage_id in sorted(job.stageIds) if job else []:
                stage = self.tracker.getStageInfo(stage_id)
                if stage is not None:
                    stages.append(stage)
        if not stages:
            return None
        first = stages[0]  # the read of the log: its job is the batch's first
        running = [s for s in stages[1:] if s.numActiveTasks > 0]
        if first.numCompletedTasks < first.numTasks or not running:
            return Reading(first.numCompletedTasks, first.numTasks)
        later = running[-1]
        return Reading(
            first.numCompletedTasks, first.numTasks, f"{later.name}: {later.numCompletedTasks}/{later.numTasks} tasks"
        )

    def show(self, final: bool = False) -> None:
        text = line(self.label, self.total, self.reading(), time.monotonic() - self.started)
        if self.tty:
            self.out.write("\r" + text.ljust(self.width) + ("\n" if final else ""))
            self.out.flush()
            self.width = len(text)
        elif not final:
            logger.info("%s", text)

    def run(self) -> None:
        every = TTY_EVERY_S if self.tty else LOG_EVERY_S
        while not self.stopped.wait(every):
            try:
                self.show()
            except Exception:
                logger.debug("progress meter failed", exc_info=True)


@contextmanager
def metered(spark: SparkSession, label: str, total: int, out: TextIO | None = None) -> Iterator[_Poller]:
    """Run the block's Spark jobs (of this thread) in a job group of their own and show their progress until it
    ends; the block gets the meter (its ``reading()`` is where the work stands)."""
    group = f"replica-meter-{id(spark)}-{time.monotonic_ns()}"
    spark.sparkContext.setJobGroup(group, label)
    poller = _Poller(spark, group, label, total, out or sys.stderr)
    poller.start()
    try:
        yield poller
    finally:
        poller.stopped.set()
        poller.join()
        if poller.tty and poller.width:
            poller.out.write("\r" + " " * poller.width + "\r")
            poller.out.flush()
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
