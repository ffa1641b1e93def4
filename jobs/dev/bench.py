"""The benchmark: ./spark-submit.sh --driver-memory 8g jobs/bench.py [--events 200000 --keys 100000 ...]

Starts its own Kafka broker (or uses --bootstrap-servers), produces a seeded workload, runs the ceiling, the
naive pattern, the peer (kafka2delta) and the materializer (copy-on-write and merge-on-read) on it one after the
other, and writes the figures as JSON and PNG (default folder: .state/bench). A benchmark, not a test: it fails
only if a contender fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from jobs._cli import guarded, setup_logging
from replica_dev.bench import CONTENDERS, GROWTH_KEYS, BenchPlan, event_log_conf, run_bench, summary_lines, write_report
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_lib.config import local_settings
from replica_lib.session import build_session


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part.replace("_", "")) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from exc


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench", description="Benchmark the materializer against its peers.")
    defaults = BenchPlan()
    parser.add_argument("--keys", type=int, default=defaults.keys, help="distinct keys of the catch-up workload")
    parser.add_argument("--events", type=int, default=defaults.events, help="changes in the catch-up backlog")
    parser.add_argument("--delete-share", type=float, default=defaults.delete_share, help="share of deletes")
    parser.add_argument("--value-bytes", type=int, default=defaults.value_bytes, help="bytes of the padding column")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="records per catch-up batch")
    parser.add_argument("--partitions", type=int, default=defaults.partitions, help="partitions of each topic")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--contenders", default=",".join(defaults.contenders), help=f"any of {','.join(CONTENDERS)} (default: all)"
    )
    parser.add_argument(
        "--fresh-contenders", default="", help="the freshness phase's contenders, among --contenders (default: all)"
    )
    parser.add_argument("--fresh-rate", type=int, default=defaults.fresh_rate, help="events/s of the freshness run")
    parser.add_argument("--fresh-seconds", type=int, default=defaults.fresh_seconds, help="0 skips freshness")
    parser.add_argument("--fresh-rows", type=int, default=defaults.fresh_rows, help="rows in the table beforehand")
    parser.add_argument(
        "--growth-rows", type=_ints, default=defaults.growth_rows, help="table sizes, e.g. 100000,1000000 ('' skips)"
    )
    parser.add_argument(
        "--growth-keys",
        type=lambda text: tuple(part.strip() for part in text.split(",") if part.strip()),
        default=defaults.growth_keys,
        help=f"key draws of the growth phase, any of {','.join(GROWTH_KEYS)} (default: both)",
    )
    parser.add_argument("--growth-batch-size", type=int, default=defaults.growth_batch_size)
    parser.add_argument("--growth-batches", type=int, default=defaults.growth_batches)
    parser.add_argument("--warmup-events", type=int, default=defaults.warmup_events, help="0 skips the warm-up")
    parser.add_argument(
        "--fold-every-batches",
        type=int,
        default=defaults.fold_every_batches,
        help="ours-mor: fold the change log after every this-many-th batch (0: never during the stream)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        help="measured runs of each fixed-cost action and reader query (the median is reported)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=defaults.rounds,
        help="run the catch-up (every contender, and the rebuild) and the freshness phase this many times each; "
        "their ratios are the median of the rounds'",
    )
    parser.add_argument("--bootstrap-servers", help="use this broker instead of starting one")
    parser.add_argument("--workdir", type=Path, help="tables and checkpoints (default: a new temporary folder)")
    parser.add_argument("--out", type=Path, help="where the JSON and PNG go (default: .state/bench)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="record each catch-up and one-batch run (JVM flight recordings) and report where the CPU went",
    )
    parser.add_argument(
        "--no-event-log", action="store_true", help="do not write Spark's event log (jobs and driver time per batch)"
    )
    args = parser.parse_args(argv)
    setup_logging()
    settings = local_settings()

    def body() -> int:
        def names(text: str) -> tuple[str, ...]:
            return tuple(c.strip() for c in text.split(",") if c.strip())

        lists = ("contenders", "fresh_contenders")
        given = {f.name: getattr(args, f.name) for f in fields(BenchPlan) if f.name not in lists}
        plan = BenchPlan(**given, contenders=names(args.contenders), fresh_contenders=names(args.fresh_contenders))
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="replica-bench-"))
        out = args.out or settings.state_dir / "bench"
        print(f"working in {workdir}", flush=True)
        extra = {"spark.sql.streaming.numRecentProgressUpdates": "1000"}
        if not args.no_event_log:
            extra |= event_log_conf(out / "eventlogs")
        spark = build_session("replica-bench", settings, extra=extra)
        if args.bootstrap_servers:
            report = run_bench(spark, plan, workdir, args.bootstrap_servers)
        else:
            with EmbeddedKafka(workdir / "broker", settings.state_dir, settings.java_home) as broker:
                report = run_bench(spark, plan, workdir, broker.bootstrap_servers)
        json_path, png_path = write_report(report, out)
        for line in summary_lines(report):
            print(line)
        print(f"report: {json_path}\nplot:   {png_path}")
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
