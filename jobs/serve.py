"""The SQL server: ./replica serve [conf/*.toml] [--port 10000] | ./replica serve stop | ./replica serve status

Starts Spark's Thrift server over the catalog (JDBC ``jdbc:hive2://127.0.0.1:<port>/default``; beeline, BI tools),
after registering every replica given (by default every ``conf/*.toml``) and the entries replicas left pending; while
it runs it registers what replicas leave within a second. It runs in the foreground until Ctrl-C or SIGTERM
(``./replica serve stop`` sends it), then stops its server and its session and releases the catalog.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from types import FrameType

from jobs._cli import USER_ERROR, guarded, setup_logging
from replica_lib.catalog import apply_pending, metastore_holder, register_catalog
from replica_lib.config import PROJECT_ROOT, load_replicas, local_settings
from replica_lib.errors import CatalogError
from replica_lib.server import (
    ServerInfo,
    alive,
    remove_server_file,
    running_server,
    server_file,
    start_thrift_server,
    thrift_conf,
    write_server_file,
)
from replica_lib.session import build_session, local_metastore, stop_session

logger = logging.getLogger("replica_lib.server")

#: How often the server registers the entries that starting replicas leave (replica_lib.catalog).
PENDING_POLL_S = 1.0
STOP_TIMEOUT_S = 120.0


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve(confs: list[str], host: str, port: int) -> int:
    settings = local_settings()
    found = running_server(settings)
    if found is not None:
        print(f"serve: error: a SQL server already runs at {found.url} (pid {found.pid}): ./replica serve stop")
        return USER_ERROR
    replicas = load_replicas(confs)
    if metastore_holder(settings):
        raise CatalogError(
            f"the local catalog ({settings.catalog_home / 'metastore'}) is open in another process (a notebook or "
            "./replica sql): close it, then start the server"
        )
    port = port or _free_port(host)
    spark = build_session("replica-sql-server", settings, catalog=True, extra=thrift_conf(host, port))
    names = register_catalog(spark, replicas, settings)
    server = start_thrift_server(spark)
    info = ServerInfo(os.getpid(), host, port)
    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        logger.info("SQL server: %s received, stopping", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        write_server_file(settings, info)
        print(f"SQL server ready: {info.url}", flush=True)
        print(f"  {len(names)} names of {len(replicas)} replicas registered; beeline -u {info.url}", flush=True)
        print("  ./replica serve stop (or Ctrl-C) stops it", flush=True)
        watch_pending = local_metastore(spark, settings)
        while not stop.wait(PENDING_POLL_S):
            if watch_pending:
                for name in apply_pending(spark, settings):
                    logger.info("SQL server: registered %s", name)
    finally:
        remove_server_file(settings, info.pid)
        server.stop()
        stop_session(spark)  # its JVM gone, and Derby's lock on the local catalog with it
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("SQL server stopped", flush=True)
    return 0


def stop_server() -> int:
    settings = local_settings()
    info = running_server(settings)
    if info is None:
        print(f"no SQL server running ({server_file(settings)})")
        return 0
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while alive(info.pid):
        if time.monotonic() > deadline:
            print(f"serve: error: the SQL server (pid {info.pid}) did not stop within {STOP_TIMEOUT_S:g}s")
            return 1
        time.sleep(0.2)  # waiting for the server's process to exit, with a deadline
    print(f"stopped the SQL server at {info.url} (pid {info.pid})")
    return 0


def status() -> int:
    info = running_server(local_settings())
    print(f"SQL server running at {info.url} (pid {info.pid})" if info else "no SQL server running")
    return 0 if info else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["stop"]:
        return stop_server()
    if argv[:1] == ["status"]:
        return status()
    parser = argparse.ArgumentParser(prog="serve", description="Serve SQL over the replicas' catalog (JDBC).")
    parser.add_argument("confs", nargs="*", help="replica files to register (default: conf/*.toml)")
    parser.add_argument("--port", type=int, default=10000, help="port to listen on (default 10000; 0: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    args = parser.parse_args(argv)
    setup_logging()
    confs = args.confs or sorted(str(p) for p in (PROJECT_ROOT / "conf").glob("*.toml"))
    return guarded(lambda: serve(confs, args.host, args.port))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
