"""The suite's time limit (pytest-timeout's) says, when it fires, that the machine was
too slow and how long the test waited; hypothesis never takes it for a failure of the
example it interrupted. No torch here: a test runs this module in a fresh pytest."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest


class MachineTooSlow(BaseException):
    """A test ran past its time limit: the machine was too slow for it (or it hung).

    A ``BaseException`` that is not an ``Exception``, so that hypothesis lets it through
    instead of replaying the example it interrupted (pytest-timeout's own failure is one
    hypothesis catches: the replay, cut short or not, was then reported as a flaky test
    or an inconsistent data generation)."""


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's ``signal`` method (the default where there is SIGALRM), raising
    `MachineTooSlow` with the wall time waited and the machine's load."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own thread method: it ends the whole run
    start = time.monotonic()

    def handler(signum: int, frame: object) -> None:
        waited = time.monotonic() - start
        load = os.getloadavg()[0]
        msg = (
            f"{item.nodeid} waited {waited:.0f} s of wall clock, past its {settings.timeout:g} s "
            f"limit (about 10 times its time on 2 idle cores): the machine was too slow (load "
            f"average {load:.1f} on {os.cpu_count()} cores) or the test hung; nothing it "
            "checks failed. Run it on a quieter machine, or raise the limit with --timeout"
        )
        raise MachineTooSlow(msg)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout calls it
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
