"""Replica status and lag: ./spark-submit.sh jobs/status.py conf/orders_a.toml conf/orders_b.toml [--json]

For each replica and table: the records it is behind the log (per partition with ``--partitions``), the age of its
newest change and of its last commit, its batch, version, rows and quarantined records, and whether it is healthy.
Exits 1 if any replica is unhealthy, its broker cannot be reached or a table cannot be read.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TextIO

from jobs._cli import FAILURE, amount, guarded, own_stdout
from replica_lib.config import load_replicas, local_settings
from replica_lib.session import build_session
from replica_lib.status import Thresholds, render, status_of, to_json


def main(argv: list[str], out: TextIO | None = None) -> int:
    """``out`` takes the status (default stdout); run as a script, stdout is kept for it alone."""
    defaults = Thresholds()
    parser = argparse.ArgumentParser(prog="status", description="Show how far behind the log replicas are.")
    parser.add_argument("confs", nargs="+", help="replica files in conf/")
    parser.add_argument("--json", action="store_true", help="print JSON for machines instead of a table")
    parser.add_argument("--partitions", action="store_true", help="also show each partition's offsets and lag")
    parser.add_argument(
        "--max-lag-records",
        type=int,
        default=defaults.max_lag_records,
        help=f"unhealthy when a table is more records behind than this (default {defaults.max_lag_records})",
    )
    parser.add_argument(
        "--max-lag-seconds",
        type=amount,
        default=defaults.max_lag_seconds,
        help="unhealthy when records wait and the table's last commit is older than this "
        f"(default {defaults.max_lag_seconds:g})",
    )
    args = parser.parse_args(argv)
    if args.max_lag_records < 0:
        parser.error("--max-lag-records must be >= 0")
    # The status is the output: logs go to stderr, warnings only; an unreachable broker is said once, in the status.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("replica_lib.topics.librdkafka").setLevel(logging.CRITICAL)
    thresholds = Thresholds(args.max_lag_records, args.max_lag_seconds)
    out = out or sys.stdout

    def body() -> int:
        configs = load_replicas(args.confs)
        spark = build_session("replica-status", local_settings())
        statuses = [status_of(spark, cfg, thresholds) for cfg in configs]
        print(to_json(statuses) if args.json else render(statuses, partitions=args.partitions), file=out)
        out.flush()
        return 0 if all(status.healthy for status in statuses) else FAILURE

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], own_stdout()))
