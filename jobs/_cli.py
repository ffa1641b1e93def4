"""What every job shares: logging to stdout, and one readable line for any failure (the trace on request)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import TextIO

from pyspark.errors import AnalysisException, PySparkException, StreamingQueryException

from replica_lib.config import local_settings
from replica_lib.errors import ReplicaError

#: Exit codes: 2 for a failure the user can fix (config, arguments, SQL, an unreachable or refused resource),
#: 1 for anything else, 130 for Ctrl-C.
USER_ERROR, FAILURE, INTERRUPTED = 2, 1, 130
DEBUG_HINT = "set REPLICA_DEBUG=1 for the full trace"


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)
    # PySpark logs every failed SQL statement with its Java trace (as JSON and as text) before raising it; the job
    # reports the error itself in one line (the trace with REPLICA_DEBUG=1).
    # So does py4j for a batch that raises (the callback's traceback, the Java trace inside it): the query's failure
    # carries the same error.
    if not local_settings().debug:
        logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL + 1)
        logging.getLogger("py4j.clientserver").setLevel(logging.CRITICAL + 1)
    # py4j logs a retried send on a closed pooled connection to the root logger at INFO, with a traceback.
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: record.levelno >= logging.WARNING or "/py4j/" not in record.pathname)
    # librdkafka reports transient states (coordinator loading, reconnects) as warnings; failures still raise.
    for client in (
        "replica_lib.producer.librdkafka",
        "replica_lib.topics.librdkafka",
        "replica_lib.monitor.librdkafka",
    ):
        logging.getLogger(client).setLevel(logging.ERROR)


def own_stdout() -> TextIO:
    """Keep standard output for the job's result: everything else the process prints goes to stderr.

    Call it before the SparkSession is built: the JVM that Spark starts (and its Ivy resolution, which prints
    ``:: loading settings ::`` on stdout) inherits the redirected descriptor, so ``--json`` output stays parseable.
    """
    result = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return result


def amount(text: str) -> float:
    """An argument that is a finite number, 0 or more (argparse's ``type``): ``nan`` passes every comparison a
    job makes (a VACUUM retention that checks nothing, a wait that never ends), ``inf`` and negatives make no sense."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, not {text!r}")
    return value


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message that says something (Spark's start with a blank line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def explain_failure(exc: BaseException) -> tuple[str, int]:
    """The one line a user sees for ``exc``, and the exit code."""
    if isinstance(exc, ReplicaError):
        return f"error: {exc}", USER_ERROR
    if isinstance(exc, AnalysisException):  # ParseException included: bad SQL, unknown table or column
        return f"error: {first_line(exc)}", USER_ERROR
    if isinstance(exc, StreamingQueryException):
        return f"error: the replica's query failed: {first_line(exc)} ({DEBUG_HINT})", FAILURE
    if isinstance(exc, PySparkException):
        return f"error: Spark: {first_line(exc)} ({DEBUG_HINT})", FAILURE
    return f"error: {type(exc).__name__}: {first_line(exc)} ({DEBUG_HINT})", FAILURE


def guarded(body: Callable[[], int]) -> int:
    """Run ``body``; any failure becomes one line on stderr and an exit code, its trace only in debug mode."""
    try:
        return body()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:
        line, code = explain_failure(exc)
        if local_settings().debug:
            traceback.print_exc()
        print(line, file=sys.stderr)
        return code
