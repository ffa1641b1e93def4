"""Per-batch Spark jobs, stages and driver time of streaming queries, from Spark's event log.

    python -m jobs.dev.eventlog <event log file or folder> [--query NAME] [--jobs] [--min-jobs N]

Write the log with ``./spark-submit.sh --conf spark.eventLog.enabled=true --conf spark.eventLog.dir=file:///DIR
--conf spark.eventLog.compress=false`` (a rolling log's folder reads as well).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from replica_dev.eventlog import EventLogError, format_jobs, format_summary, read_batches, summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eventlog", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="an event log file (or a rolling log's folder)")
    parser.add_argument("--query", help="only the queries whose name contains this")
    parser.add_argument("--jobs", action="store_true", help="list the jobs of each query's median batch")
    parser.add_argument("--min-jobs", type=int, default=1, help="ignore batches with fewer jobs (empty batches)")
    args = parser.parse_args(argv)
    if not args.path.exists():
        print(f"eventlog: {args.path} does not exist (give a file written by spark.eventLog.dir)", file=sys.stderr)
        return 2
    try:
        batches = read_batches(args.path)
    except EventLogError as exc:
        print(f"eventlog: {exc}", file=sys.stderr)
        return 2
    if args.query:
        batches = [b for b in batches if args.query in b.name]
    rows = summary(batches, args.min_jobs)
    for line in format_summary(rows):
        print(line)
    if args.jobs:
        for row in rows:
            group = [b for b in batches if (b.name or b.query_id) == row["query"] and len(b.jobs) >= args.min_jobs]
            group = [b for b in group if b.add_batch_ms is not None]
            if not group:
                continue
            median = statistics.median_low([b.add_batch_ms or 0 for b in group])
            print()
            print("\n".join(format_jobs(next(b for b in group if b.add_batch_ms == median))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
