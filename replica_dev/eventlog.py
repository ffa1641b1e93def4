"""Per-batch figures from Spark's event log: Spark jobs, stages, tasks, and driver time between jobs.

A streaming query's jobs carry its id (``sql.streaming.queryId``) and the micro-batch (``streaming.sql.batchId``)
as local properties, which the event log records with each job start, threads of the ``foreachBatch`` handler
included (``inheritable_thread_target``). A batch's wall time is its progress report's ``addBatch``; what no job
covers of it is time the driver spent planning, committing and waiting (``driver_ms``). The whole micro-batch,
``triggerExecution`` (``trigger_ms``), also holds the query's own planning, before ``addBatch``.

Run it on a log written with ``--conf spark.eventLog.enabled=true --conf spark.eventLog.dir=file:///some/dir
--conf spark.eventLog.compress=false`` (Spark compresses its logs with zstd unless told not to):
``python -m jobs.dev.eventlog /some/dir/<app-id> [--query NAME] [--jobs]``.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUERY_ID = "sql.streaming.queryId"
BATCH_ID = "streaming.sql.batchId"
DESCRIPTION = "spark.job.description"
_PROGRESS = "org.apache.spark.sql.streaming.StreamingQueryListener$QueryProgressEvent"


@dataclass
class Job:
    """One Spark job: when it ran, what it was called, its stages and tasks and their executor CPU time."""

    job_id: int
    description: str
    submitted_ms: int
    ended_ms: int = 0
    stages: list[int] = field(default_factory=list)
    tasks: int = 0
    cpu_ms: float = 0.0


@dataclass
class Batch:
    """One micro-batch of one query, with its jobs in submission order."""

    query_id: str
    batch_id: int
    name: str = ""
    add_batch_ms: int | None = None
    #: The whole micro-batch (Spark's ``triggerExecution``): the offsets, the query's planning, ``addBatch``, the
    #: commit. Planning a decode in the query's own plan counts here, not in ``addBatch``.
    trigger_ms: int | None = None
    jobs: list[Job] = field(default_factory=list)

    @property
    def job_ms(self) -> int:
        """Time covered by at least one running job (jobs that overlap count once)."""
        spans = sorted((j.submitted_ms, max(j.ended_ms, j.submitted_ms)) for j in self.jobs)
        covered, end = 0, None
        for start, stop in spans:
            if end is None or start > end:
                covered += stop - start
                end = stop
            elif stop > end:
                covered += stop - end
                end = stop
        return covered

    @property
    def driver_ms(self) -> int | None:
        """The batch's wall time that no job covers: planning, commits, listing, waiting on the driver."""
        return None if self.add_batch_ms is None else max(0, self.add_batch_ms - self.job_ms)

    @property
    def stages(self) -> int:
        return sum(len(j.stages) for j in self.jobs)

    @property
    def tasks(self) -> int:
        return sum(j.tasks for j in self.jobs)

    @property
    def cpu_ms(self) -> float:
        return sum(j.cpu_ms for j in self.jobs)


#: Suffixes of the files Spark's event log codecs write (``spark.eventLog.compression.codec``; zstd by default).
COMPRESSED = (".zstd", ".lz4", ".lzf", ".snappy")
_HINT = "write the log with --conf spark.eventLog.compress=false"


class EventLogError(ValueError):
    """A file that is not a plain-text Spark event log; says how to write one that is."""


def _event_files(path: Path) -> list[Path]:
    """The event files of a log: the file itself, or a rolling log's ``events_<n>_<app>`` files in order.

    A rolling log's folder also holds an ``appstatus_`` marker and, on a local file system, hidden checksums.
    """
    if not path.is_dir():
        return [path]
    files = [p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "appstatus_"))]

    def index(file: Path) -> tuple[int, str]:
        number = file.name.split("_")[1] if file.name.startswith("events_") else ""
        return (int(number) if number.isdigit() else 0, file.name)

    return sorted(files, key=index)


def _events(path: Path) -> Iterator[dict[str, Any]]:
    for file in _event_files(path):
        if file.suffix in COMPRESSED:
            raise EventLogError(f"{file} is compressed ({file.suffix[1:]}), which this reader does not decode: {_HINT}")
        read = 0
        with file.open(encoding="utf-8") as lines:
            try:
                for line in lines:
                    read += 1
                    if line.strip():
                        yield json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise EventLogError(f"{file}:{read or 1}: not a plain-text Spark event log: {_HINT}") from exc


def read_batches(path: Path) -> list[Batch]:
    """Every micro-batch found in an event log (a file, or a rolling log's folder), in order of appearance."""
    batches: dict[tuple[str, int], Batch] = {}
    jobs: dict[int, tuple[Job, Batch]] = {}
    listed: dict[int, Job] = {}  # stage -> the newest job that lists it
    stage_job: dict[int, Job] = {}  # stage -> the job it ran for (submitted stages only: skipped ones never are)
    for event in _events(path):
        kind = event.get("Event")
        if kind == "SparkListenerJobStart":
            props = event.get("Properties") or {}
            if QUERY_ID not in props or BATCH_ID not in props:
                continue
            key = (str(props[QUERY_ID]), int(props[BATCH_ID]))
            batch = batches.setdefault(key, Batch(*key))
            description = str(props.get(DESCRIPTION) or "").strip().splitlines()
            job = Job(int(event["Job ID"]), description[0] if description else "", int(event["Submission Time"]))
            batch.jobs.append(job)
            jobs[job.job_id] = (job, batch)
            for stage in event.get("Stage IDs", []):
                listed[int(stage)] = job
        elif kind == "SparkListenerStageSubmitted":
            stage = int(event["Stage Info"]["Stage ID"])
            if stage in listed:
                stage_job[stage] = listed[stage]
                listed[stage].stages.append(stage)
        elif kind == "SparkListenerJobEnd" and int(event["Job ID"]) in jobs:
            jobs[int(event["Job ID"])][0].ended_ms = int(event["Completion Time"])
        elif kind == "SparkListenerTaskEnd" and int(event.get("Stage ID", -1)) in stage_job:
            job = stage_job[int(event["Stage ID"])]
            job.tasks += 1
            metrics = event.get("Task Metrics") or {}
            job.cpu_ms += float(metrics.get("Executor CPU Time", 0)) / 1e6
        elif kind == _PROGRESS:
            progress = event.get("progress") or {}
            key = (str(progress.get("id")), int(progress.get("batchId", -1)))
            batch = batches.setdefault(key, Batch(*key))
            batch.name = str(progress.get("name") or "")
            durations = progress.get("durationMs") or {}
            batch.add_batch_ms = durations.get("addBatch")
            batch.trigger_ms = durations.get("triggerExecution")
    return list(batches.values())


def _median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def summary(batches: list[Batch], min_jobs: int = 1) -> list[dict[str, Any]]:
    """Per query: batches with work, and the median jobs, stages, tasks, wall, job and driver ms per batch."""
    by_query: dict[str, list[Batch]] = defaultdict(list)
    for batch in batches:
        if len(batch.jobs) >= min_jobs and batch.add_batch_ms is not None:
            by_query[batch.name or batch.query_id].append(batch)
    rows = []
    for name, group in by_query.items():
        rows.append(
            {
                "query": name,
                "batches": len(group),
                "jobs": _median(len(b.jobs) for b in group),
                "stages": _median(b.stages for b in group),
                "tasks": _median(b.tasks for b in group),
                "trigger_ms": _median(float(b.trigger_ms or 0) for b in group),
                "add_batch_ms": _median(float(b.add_batch_ms or 0) for b in group),
                "job_ms": _median(b.job_ms for b in group),
                "driver_ms": _median(float(b.driver_ms or 0) for b in group),
                "cpu_ms": _median(b.cpu_ms for b in group),
            }
        )
    return rows


def format_summary(rows: list[dict[str, Any]]) -> list[str]:
    width = max([28, *(len(str(r["query"])) for r in rows)])  # whole names: the benchmark's differ at their end
    header = f"{'query':<{width}} {'batches':>7} {'jobs':>5} {'stages':>6} {'tasks':>6} {'trigger':>8} "
    header += f"{'batch ms':>9} {'in jobs':>8} "
    header += f"{'driver':>7} {'cpu ms':>7}"
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['query']:<{width}} {r['batches']:>7} {r['jobs']:>5.0f} {r['stages']:>6.0f} {r['tasks']:>6.0f} "
            f"{r['trigger_ms']:>8.0f} {r['add_batch_ms']:>9.0f} {r['job_ms']:>8.0f} {r['driver_ms']:>7.0f} "
            f"{r['cpu_ms']:>7.0f}"
        )
    return lines


def format_jobs(batch: Batch) -> list[str]:
    """One batch's jobs in order: start offset, duration, stages, tasks, description."""
    if not batch.jobs:
        return []
    start = batch.jobs[0].submitted_ms
    lines = [
        f"{batch.name or batch.query_id} batch {batch.batch_id}: {len(batch.jobs)} jobs, addBatch "
        f"{batch.add_batch_ms} ms, in jobs {batch.job_ms} ms, driver {batch.driver_ms} ms"
    ]
    for job in batch.jobs:
        lines.append(
            f"  +{job.submitted_ms - start:>6} ms {job.ended_ms - job.submitted_ms:>6} ms  {len(job.stages)} stages "
            f"{job.tasks:>3} tasks  {job.description[:90]}"
        )
    return lines
