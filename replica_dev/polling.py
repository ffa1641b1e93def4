"""Waiting for a condition with a deadline: the poll loop of the dev harness and the tests."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.2


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, error: type[Exception] = TimeoutError) -> None:
    """Poll ``condition`` until it holds; ``error`` naming ``what`` once ``timeout_s`` have passed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)
