"""The materializer with a crash window, for the fault harness: REPLICA_CRASH_AT=point[:batch] and the same
arguments as jobs/materialize.py. Users run jobs/materialize.py."""

from __future__ import annotations

import argparse
import os
import sys

from jobs._cli import guarded, setup_logging
from replica_dev.faults import CRASH_ENV, crash_point
from replica_lib.config import load_replica, local_settings
from replica_lib.recovery import lock_checkpoint
from replica_lib.session import build_session
from replica_lib.stream import run_replica


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="faulty_replica", description="Materialize a replica; crash on cue.")
    parser.add_argument("conf", help="the replica's file")
    args = parser.parse_args(argv)
    setup_logging()

    def body() -> int:
        crash = crash_point(os.environ.get(CRASH_ENV))
        cfg = load_replica(args.conf)
        # A second instance is refused at once, before its JVM starts (the start takes the lock it holds).
        lock_checkpoint(cfg)
        spark = build_session(f"replica-{cfg.name}", local_settings())
        run_replica(spark, cfg, hooks=crash.hooks() if crash else None)
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
