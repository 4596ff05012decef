"""The tests' one way to wait for something another process or thread does."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(condition: Callable[[], object], timeout_s: float = 120.0, what: str = "condition",
          interval_s: float = 0.05):
    """Call `condition` every `interval_s` until it returns something truthy, and return that; fail the test,
    naming `what`, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
