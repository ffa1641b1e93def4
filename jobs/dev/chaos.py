"""The fault harness as a job, for long runs: ./replica chaos --kills 50 --events 20000 --keys 2000

Starts its own Kafka broker, runs replica "chaos" through spark-submit.sh while a producer writes, kills and
restarts it (every crash window first, then random SIGKILLs), and prints the oracle's figures. Exit 1 if any
figure that must be zero is not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from jobs._cli import guarded, setup_logging
from replica_dev.chaos import ChaosPlan, layout_windows, run_broker_outages, run_chaos
from replica_dev.embedded_kafka import EmbeddedKafka
from replica_lib.config import COPY_ON_WRITE, LAYOUTS, local_settings
from replica_lib.session import build_session


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="chaos", description="Kill a running replica over and over; check it.")
    parser.add_argument("--kills", type=int, default=20, help="random SIGKILLs (default 20)")
    parser.add_argument("--window-repeats", type=int, default=2, help="runs of each crash window (default 2)")
    parser.add_argument(
        "--events",
        type=int,
        default=0,
        help="write at least this many changes (default: as many as --rate gives while the kills last)",
    )
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=20.0, help="changes per second written (default 20)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, help="default: a new temporary folder")
    parser.add_argument(
        "--deletion-vectors",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: each MERGE chooses (default); on/off: every MERGE writes deletion vectors, or none",
    )
    parser.add_argument(
        "--layout",
        action="append",
        choices=LAYOUTS,
        help="a table of this layout (repeat for one table of each; default copy-on-write)",
    )
    parser.add_argument(
        "--second-instance", action="store_true", help="at the end, start a second instance by mistake: it must fail"
    )
    parser.add_argument(
        "--broker-outages",
        type=int,
        default=0,
        help="then kill and restart the broker this many times under a running replica, and start one while it is "
        "down (default 0: none)",
    )
    args = parser.parse_args(argv)
    if args.broker_outages < 0:
        parser.error("--broker-outages must be 0 or more")
    setup_logging()
    layouts = tuple(dict.fromkeys(args.layout or [COPY_ON_WRITE]))
    try:
        plan = ChaosPlan(
            keys=args.keys,
            events=args.events,
            kills=args.kills,
            crash_windows=layout_windows(layouts) * args.window_repeats,
            rate=args.rate,
            seed=args.seed,
            deletion_vectors={"auto": None, "on": True, "off": False}[args.deletion_vectors],
            layouts=layouts,
            second_instance=args.second_instance,
        )
    except ValueError as exc:
        parser.error(str(exc))
    settings = local_settings()

    def body() -> int:
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="replica-chaos-"))
        print(f"working in {workdir}")
        with EmbeddedKafka(workdir / "broker", settings.state_dir, settings.java_home) as broker:
            spark = build_session("replica-chaos-oracle", settings, master="local[1]")
            reports = [run_chaos(spark, plan, workdir, broker.bootstrap_servers)]
            if args.broker_outages > 0:
                reports.append(run_broker_outages(spark, plan, workdir / "outages", broker, args.broker_outages))
        for report in reports:
            print("\n".join(report.lines()))
        return 0 if all(report.ok for report in reports) else 1

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
