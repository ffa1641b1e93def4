"""Catalog names of replicas: ./replica catalog register conf/orders_a.toml [conf/orders_b.toml ...]

Registers each replica's names (``<replica>.<table>`` and the others of :mod:`replica_lib.catalog`) in the catalog,
and the entries replicas left pending; safe to repeat. While the SQL server holds the local catalog, the entries go
through it (this waits until it has registered them); otherwise this opens the catalog itself.
"""

from __future__ import annotations

import argparse
import sys
import time

from jobs._cli import guarded, setup_logging
from replica_lib.catalog import entries, leave_pending, metastore_holder, register_catalog
from replica_lib.config import load_replicas, local_settings
from replica_lib.errors import CatalogError
from replica_lib.server import running_server
from replica_lib.session import build_session, local_metastore, stop_session

#: How long to wait for the SQL server to register what was left for it.
SERVER_TIMEOUT_S = 60.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="catalog", description="Register replicas' tables by name in the catalog.")
    parser.add_argument("action", choices=("register",))
    parser.add_argument("confs", nargs="+", help="replica files in conf/")
    args = parser.parse_args(argv)
    setup_logging()

    def body() -> int:
        replicas = load_replicas(args.confs)
        settings = local_settings()
        server = running_server(settings)
        if server is not None:
            left = [leave_pending(cfg, settings) for cfg in replicas]
            deadline = time.monotonic() + SERVER_TIMEOUT_S
            while any(path.exists() for path in left):
                if time.monotonic() > deadline:
                    raise CatalogError(
                        f"the SQL server at {server.url} did not register the replicas within {SERVER_TIMEOUT_S:g}s; "
                        f"see its log (they stay in {left[0].parent} for it)"
                    )
                time.sleep(0.2)  # the server registers pending entries every second
            for cfg in replicas:
                names = ", ".join(f"{cfg.name}.{e.name}" for e in entries(cfg))
                print(f"registered through the SQL server at {server.url}: {names}")
            return 0
        if metastore_holder(settings):
            raise CatalogError(
                f"the local catalog ({settings.catalog_home / 'metastore'}) is open in another process (a notebook "
                "or ./replica sql): close it, or start ./replica serve, which registers what replicas leave"
            )
        spark = build_session("replica-catalog", settings, catalog=True)
        for name in register_catalog(spark, replicas, settings):
            print(f"registered {name}")
        if local_metastore(spark, settings):
            stop_session(spark)  # releases the local catalog before the command returns
        return 0

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
