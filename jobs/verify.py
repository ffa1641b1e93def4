"""Compare a table of two replicas of one log (or a replica and its rebuild) at the same offsets:

    ./spark-submit.sh jobs/verify.py conf/orders_a.toml conf/orders_b.toml [--table orders]
    ./spark-submit.sh jobs/verify.py conf/orders_a.toml --rebuilt /data/orders_a_rebuild

Exit 0 if the tables are equal row for row, 1 if they differ (the first differing keys are printed), 2 if they
cannot be compared (e.g. recorded at different offsets: the message says how to bring them to one point).
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import FAILURE, USER_ERROR, guarded, setup_logging
from replica_lib.config import load_replica, local_settings
from replica_lib.rebuild import rebuild_config
from replica_lib.session import build_session
from replica_lib.verify import compare_tables, report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="verify", description="Compare two replica tables row for row.")
    parser.add_argument("conf", help="a replica's file")
    parser.add_argument("other", nargs="?", help="a second replica's file (of the same log)")
    parser.add_argument("--rebuilt", help="compare with the rebuild of the replica in this folder instead")
    parser.add_argument("--table", help="the table to compare (default: the replica's only table)")
    args = parser.parse_args(argv)
    if (args.other is None) == (args.rebuilt is None):
        print("verify: error: give a second replica's file or --rebuilt FOLDER (one of them)", file=sys.stderr)
        return USER_ERROR
    setup_logging()

    def body() -> int:
        left = load_replica(args.conf)
        right = load_replica(args.other) if args.other else rebuild_config(left, args.rebuilt)
        spark = build_session(f"replica-verify-{left.name}", local_settings())
        ltable = left.table_named(args.table, "--table")
        rtable = right.table_named(ltable.name, "--table")
        comparison = compare_tables(spark, (left, ltable), (right, rtable))
        print(report(f"{left.name}.{ltable.name}", f"{right.name}.{rtable.name}", comparison))
        return 0 if comparison.equal else FAILURE

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
