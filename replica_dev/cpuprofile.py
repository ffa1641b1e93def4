"""Where a run's CPU goes: a JVM flight recording of Spark's threads, its samples summed by kind of work.

The benchmark's ``--profile`` records each catch-up and one-batch run of a contender (:class:`Recorder`, started and
stopped through the JVM's own ``jdk.jfr`` API, so no launch option is needed) and sums its execution samples by
:data:`KINDS`: the innermost frame that names a kind decides a sample, frames of the JDK itself are passed over
(a ``String`` method inside Jackson counts as JSON parsing), except that code generation counts wherever it is on
the stack (:data:`ENCLOSING`). Samples of Spark's task threads and of every other
thread (the driver: planning, Delta's commits, the micro-batch's bookkeeping) are kept apart. A sample stands for
:data:`SAMPLE_MS` of CPU (time in native code is not sampled); divided by the changes a run applied, contenders
compare by the work each change costs, whatever their wall time.

``python -m jobs.dev.cpuprofile recording.jfr`` prints the same summary for any recording (``jfr`` of the JDK reads it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from replica_lib.errors import SetupError

#: Kinds of work, by the package or class prefix of a frame; the first prefix that matches the innermost frame
#: that has one decides. Frames of no kind (the JDK's, Scala's collections) are passed over, outwards.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("JSON parsing", ("com.fasterxml.jackson.", "org.apache.spark.sql.catalyst.json.")),
    ("regular expressions", ("java.util.regex.",)),
    ("string functions", ("org.apache.spark.unsafe.types.UTF8String", "org.apache.spark.unsafe.UTF8StringBuilder")),
    ("Kafka reads", ("org.apache.kafka.", "org.apache.spark.sql.kafka010.")),
    ("compression", ("com.github.luben.zstd.", "org.xerial.snappy.", "net.jpountz.", "io.airlift.compress.")),
    ("Parquet", ("org.apache.parquet.", "org.apache.spark.sql.execution.datasources.parquet.")),
    (
        "shuffle and sort",
        (
            "org.apache.spark.shuffle.",
            "org.apache.spark.util.collection.",
            "org.apache.spark.sql.execution.UnsafeExternalRowSorter",
            "org.apache.spark.sql.execution.UnsafeKVExternalSorter",
            "org.apache.spark.unsafe.map.",
            "org.apache.spark.sql.execution.exchange.",
        ),
    ),
    ("block store (checkpoints, broadcasts)", ("org.apache.spark.storage.", "org.apache.spark.broadcast.")),
    ("serialization", ("org.apache.spark.serializer.", "com.esotericsoftware.kryo.", "java.io.Object")),
    ("code generation", ("org.codehaus.", "org.apache.spark.sql.catalyst.expressions.codegen.")),
    ("Delta", ("io.delta.", "org.apache.spark.sql.delta.")),
    (
        "query planning",
        (
            "org.apache.spark.sql.catalyst.analysis.",
            "org.apache.spark.sql.catalyst.optimizer.",
            "org.apache.spark.sql.catalyst.trees.",
            "org.apache.spark.sql.catalyst.plans.",
            "org.apache.spark.sql.catalyst.rules.",
            "org.apache.spark.sql.execution.SparkStrategies",
            "org.apache.spark.sql.execution.QueryExecution",
            "org.apache.spark.sql.execution.adaptive.",
        ),
    ),
    ("Hadoop file system", ("org.apache.hadoop.",)),
    (
        "rows and expressions",
        (
            "org.apache.spark.sql.catalyst.expressions.",
            "org.apache.spark.sql.catalyst.InternalRow",
            "org.apache.spark.sql.catalyst.util.",
            "org.apache.spark.sql.execution.",
        ),
    ),
    ("class loading", ("java.lang.ClassLoader", "jdk.internal.loader.", "java.util.zip.", "java.util.jar.")),
    ("Spark scheduling", ("org.apache.spark.scheduler.", "org.apache.spark.executor.", "org.apache.spark.rpc.")),
)
OTHER = "other"
#: Spark's executors name the threads that run tasks so (``Executor task launch worker-3``, ``Executor task idle
#: worker#7``: a recording keeps the name a thread had when it first saw it).
TASK_THREAD = "Executor task "
#: How often the recorder samples each thread that runs Java code.
SAMPLE_MS = 10
#: How deep a sample's stack is read: deep enough to pass the JDK's frames to the first of a kind.
STACK_DEPTH = 48


class ProfileError(SetupError):
    """A recording could not be read (the JDK's ``jfr`` tool is missing, or the file is not a recording)."""


@dataclass
class Profile:
    """A recording's execution samples by kind of work, on task threads and on every other thread (the driver)."""

    tasks: Counter[str] = field(default_factory=Counter)
    driver: Counter[str] = field(default_factory=Counter)

    def add(self, thread: str, frames: list[str]) -> None:
        (self.tasks if thread.startswith(TASK_THREAD) else self.driver)[kind_of(frames)] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"tasks": dict(self.tasks.most_common()), "driver": dict(self.driver.most_common())}


#: Kinds that a frame anywhere on the stack decides: code generation formats its code with regular expressions and
#: loads the classes it compiles, which are its own cost, not the query's.
ENCLOSING = ("code generation",)


def kind_of(frames: Sequence[str]) -> str:
    """The kind of work of a sample, from its frames (innermost first: ``package.Class.method``)."""
    for kind, prefixes in KINDS:
        if kind in ENCLOSING and any(frame.startswith(prefixes) for frame in frames):
            return kind
    for frame in frames:
        for kind, prefixes in KINDS:
            if frame.startswith(prefixes):
                return kind
    return OTHER


class Recorder:
    """A flight recording of this process's JVM (Spark's driver; in local mode its executors too)."""

    def __init__(self, spark: SparkSession, path: Path) -> None:
        jvm = spark.sparkContext._jvm
        assert jvm is not None
        self.path = path
        # Execution samples only: the JDK's "profile" settings also record allocations, threads and processes,
        # which cost a run far more than its samples do.
        self._recording = jvm.jdk.jfr.Recording()
        self._recording.enable("jdk.ExecutionSample").withPeriod(jvm.java.time.Duration.ofMillis(SAMPLE_MS))
        self._file = jvm.java.io.File(str(path))
        #: The JDK this JVM runs on, whose ``jfr`` tool reads the recording.
        self.java_home = Path(str(jvm.java.lang.System.getProperty("java.home")))

    def warm_up(self) -> None:
        """Start and stop the recorder once, unrecorded, so that the first run recorded does not pay for starting
        the recorder itself (its classes, its threads); and check that its recordings can be read."""
        jfr_tool(self.java_home)
        self._recording.start()
        self._recording.stop()

    def __enter__(self) -> Recorder:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._recording.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._recording.stop()
            self._recording.dump(self._file.toPath())
        finally:
            self._recording.close()


_SAMPLE = "jdk.ExecutionSample {"
_THREAD = re.compile(r'^\s*sampledThread = "(.*)" \(')
_FRAME = re.compile(r"^\s+([\w$.<>]+)\(")


def jfr_tool(java_home: Path | None = None) -> str:
    """The JDK's ``jfr`` tool: that of ``java_home``, else the one on the PATH."""
    tool = (shutil.which("jfr", path=str(java_home / "bin")) if java_home else None) or shutil.which("jfr")
    if tool is None:
        raise ProfileError("the JDK's jfr tool was not found (in the JDK's bin folder, nor on the PATH): install a JDK")
    return tool


def read(path: Path, java_home: Path | None = None) -> Profile:
    """Sum a recording's execution samples by kind (the JDK's ``jfr`` tool reads it, see :func:`jfr_tool`)."""
    command = [
        jfr_tool(java_home),
        "print",
        "--events",
        "jdk.ExecutionSample",
        "--stack-depth",
        str(STACK_DEPTH),
        str(path),
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None
        profile = _parse(process.stdout)
        errors = process.stderr.read() if process.stderr else ""
    if process.returncode:
        raise ProfileError(f"jfr print {path}: {errors.strip() or f'exit status {process.returncode}'}")
    return profile


def _parse(lines: Iterable[str]) -> Profile:
    profile = Profile()
    thread: str | None = None
    frames: list[str] = []
    for line in lines:
        if line.startswith(_SAMPLE):
            if thread is not None:
                profile.add(thread, frames)
            thread, frames = "", []
        elif thread is not None:
            if match := _THREAD.match(line):
                thread = match.group(1)
            elif match := _FRAME.match(line):
                frames.append(match.group(1))
    if thread is not None:
        profile.add(thread, frames)
    return profile


def table(profiles: dict[str, dict[str, Any]], changes: dict[str, int] | None = None) -> Iterator[str]:
    """Sampled CPU time (samples times :data:`SAMPLE_MS`) by kind, a column per run, task threads then the driver's;
    per 1,000 changes where ``changes`` gives each run's."""
    names = list(profiles)
    width = max(10, *(len(n) + 2 for n in names))
    unit = "CPU ms per 1,000 changes" if changes else "CPU ms"
    for side, title in (("tasks", "task threads"), ("driver", "driver threads")):
        kinds = Counter[str]()
        for entry in profiles.values():
            kinds.update(entry.get(side, {}))
        if not kinds:
            continue
        yield f"{f'{title}, {unit}':<44}" + "".join(f"{n:>{width}}" for n in names)
        for kind, _ in kinds.most_common():
            cells = "".join(f"{_ms(profiles[n].get(side, {}).get(kind, 0), changes, n):>{width}}" for n in names)
            yield f"  {kind:<42}{cells}"
        totals = "".join(f"{_ms(sum(profiles[n].get(side, {}).values()), changes, n):>{width}}" for n in names)
        yield f"  {'all':<42}{totals}"


def _ms(samples: int, changes: dict[str, int] | None, name: str) -> str:
    if changes is None:
        return str(samples * SAMPLE_MS)
    return f"{samples * SAMPLE_MS * 1000 / changes[name]:.1f}" if changes.get(name) else "-"
