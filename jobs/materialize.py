"""Run one replica: ./spark-submit.sh jobs/materialize.py conf/orders_a.toml [--available-now]"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import guarded, setup_logging
from replica_lib.config import load_replica, local_settings
from replica_lib.recovery import lock_checkpoint
from replica_lib.session import build_session
from replica_lib.stream import run_replica


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="materialize", description="Materialize one replica into Delta.")
    parser.add_argument("conf", help="the replica's file in conf/")
    parser.add_argument(
        "--available-now",
        action="store_true",
        help="apply everything in the log now, then stop (default: run until SIGTERM/Ctrl-C)",
    )
    args = parser.parse_args(argv)
    setup_logging()

    def body() -> int:
        cfg = load_replica(args.conf)
        # A second instance is refused at once, before its JVM starts (the start takes the lock it holds).
        lock_checkpoint(cfg)
        spark = build_session(f"replica-{cfg.name}", local_settings())
        run_replica(spark, cfg, available_now=True if args.available_now else None)
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
