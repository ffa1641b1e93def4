"""What every job shares: logging to stdout, and one readable line (exit 2) for any expected failure."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from replica_lib.errors import ReplicaError


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)
    # py4j logs a retried send on a closed pooled connection to the root logger at INFO, with a traceback.
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: record.levelno >= logging.WARNING or "/py4j/" not in record.pathname)
    # librdkafka reports transient states (coordinator loading, reconnects) as warnings; failures still raise.
    for client in ("replica_lib.producer.librdkafka", "replica_lib.topics.librdkafka"):
        logging.getLogger(client).setLevel(logging.ERROR)


def guarded(body: Callable[[], int]) -> int:
    """Run ``body``; a ReplicaError becomes one line on stderr and exit code 2, Ctrl-C exit code 130."""
    try:
        return body()
    except ReplicaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
