"""SQL over a replica's tables: ./replica sql conf/orders_a.toml "SELECT status, count(*) FROM orders GROUP BY 1"

Each table of the replica is a view named after it (``orders``), plus ``<table>_quarantine`` for its rejects.
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs._cli import guarded, setup_logging
from replica_lib.config import load_replica, local_settings
from replica_lib.session import build_session
from replica_lib.views import register_views


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sql", description="Run SQL over a replica's Delta tables.")
    parser.add_argument("conf", help="the replica's file in conf/")
    parser.add_argument("queries", nargs="+", help="one or more SQL queries; each result is printed")
    parser.add_argument("--output", help="also write the last query's rows to this file as JSON lines")
    parser.add_argument("--limit", type=int, default=50, help="rows to print per query (default 50)")
    args = parser.parse_args(argv)
    setup_logging()

    def body() -> int:
        cfg = load_replica(args.conf)
        spark = build_session(f"replica-sql-{cfg.name}", local_settings())
        register_views(spark, cfg)
        for query in args.queries:
            print(f"\n{query}")
            result_df = spark.sql(query)
            result_df.show(args.limit, truncate=False)
        if args.output:
            with open(args.output, "w") as out:
                for row in result_df.toLocalIterator():
                    out.write(json.dumps(row.asDict(recursive=True), default=str) + "\n")
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
