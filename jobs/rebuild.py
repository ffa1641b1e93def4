"""Rebuild a replica from the log into tables of their own:

    ./spark-submit.sh jobs/rebuild.py conf/orders_a.toml --into /data/orders_a_rebuild [--until orders:0:500 ...]
        [--verify]

Replays the replica's topics from their earliest offsets up to the log's end when it starts (or ``--until``, one
topic:partition:offset end per partition, exclusive) into ``<into>/<table>``, beside the live tables, which it never
touches. Run it again after a crash: it finishes the same plan. ``--verify`` then compares each rebuilt table with
the live one if the live one has applied the log to the same offsets. A replica started on the rebuilt tables with
a new, empty checkpoint goes on from their offsets.

``--swap`` then swaps the rebuilt tables in for the live ones (see ``replica_lib.swap``): it waits for the live
replica to stop (``--wait`` seconds; SIGTERM stops it after its batch), catches the rebuilt tables up to where it
stopped, replaces each live table's rows in one commit and moves the live checkpoint aside; start the replica again
and it goes on from there. With ``--verify`` the comparison is made just before the swap, as a report.
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import FAILURE, USER_ERROR, amount, guarded, setup_logging
from replica_lib.config import load_replica, local_settings
from replica_lib.progress import Offsets
from replica_lib.reads import parse_position
from replica_lib.rebuild import rebuild, rebuild_config
from replica_lib.session import build_session
from replica_lib.swap import Swapped, swap
from replica_lib.verify import compare_tables, report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rebuild", description="Rebuild a replica from the log, beside it.")
    parser.add_argument("conf", help="the replica's file in conf/")
    parser.add_argument("--into", required=True, help="folder for the rebuilt tables (apart from the live ones)")
    parser.add_argument(
        "--until",
        action="append",
        default=[],
        metavar="TOPIC:PARTITION:OFFSET",
        help="apply the records below this offset of the partition (one per partition; default: the log's end)",
    )
    parser.add_argument("--verify", action="store_true", help="compare each rebuilt table with the live one")
    parser.add_argument("--swap", action="store_true", help="then swap the rebuilt tables in for the live ones")
    parser.add_argument(
        "--wait",
        type=amount,
        default=3600.0,
        metavar="SECONDS",
        help="--swap: how long to wait for the replica to stop",
    )
    parser.add_argument(
        "--live-stopped",
        action="store_true",
        help="--swap with a checkpoint on shared storage: you have stopped the live replica (no lock can tell)",
    )
    args = parser.parse_args(argv)
    try:
        until = _ends(args.until)
    except ValueError as exc:
        print(f"rebuild: error: --until: {exc}", file=sys.stderr)
        return USER_ERROR
    if (args.wait != 3600.0 or args.live_stopped) and not args.swap:
        print("rebuild: error: --wait and --live-stopped go with --swap", file=sys.stderr)
        return USER_ERROR
    setup_logging()

    def body() -> int:
        cfg = load_replica(args.conf)
        shadow = rebuild_config(cfg, args.into)
        spark = build_session(f"replica-rebuild-{cfg.name}", local_settings())
        stats = rebuild(spark, cfg, args.into, until)
        print(
            f"rebuilt {cfg.name} into {args.into}: {stats.records} records, {stats.upserts} rows written, "
            f"{stats.deletes} deletes, {stats.quarantined} quarantined, {stats.seconds:.1f}s"
        )
        if args.swap:
            swapped = swap(spark, cfg, args.into, args.wait, args.live_stopped, args.verify)
            for line in swapped.verified:
                print(line)
            print(_swap_line(cfg.name, swapped))
            return 0
        if not args.verify:
            return 0
        equal = True
        for live, rebuilt in zip(cfg.tables, shadow.tables, strict=True):
            comparison = compare_tables(spark, (cfg, live), (shadow, rebuilt))
            print(report(f"{cfg.name}.{live.name}", f"rebuilt {rebuilt.name}", comparison))
            equal = equal and comparison.equal
        return 0 if equal else FAILURE

    return guarded(body)


def _swap_line(name: str, swapped: Swapped) -> str:
    ends = ", ".join(
        f"{t}:" + ",".join(f"{p}={o}" for p, o in sorted(parts.items()))
        for t, parts in sorted(swapped.plan.ends.items())
    )
    if swapped.already:
        return f"swapped {name} already: its tables stand at {ends}; the old checkpoint is {swapped.checkpoint_aside}"
    return (
        f"swapped {name}: its tables hold the rebuilt rows at {ends} ({swapped.caught_up} records caught up, "
        f"{swapped.caught_up_stopped} of them while the replica was stopped); the "
        f"replica was stopped for {swapped.paused_s:.1f} s of the swap; its old checkpoint is "
        f"{swapped.checkpoint_aside}. Start the replica again: it goes on from there under a new checkpoint"
    )


def _ends(texts: list[str]) -> Offsets | None:
    if not texts:
        return None
    ends: Offsets = {}
    for text in texts:
        position = parse_position(text)
        ends.setdefault(position.topic, {})[position.partition] = position.offset
    return ends


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
