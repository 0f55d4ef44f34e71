"""A line every so often while a long benchmark step runs, so that a terminal is never silent for
minutes: what runs, for how long so far, and how long it should take where an earlier run of the same
step says so. A thread, because the step itself (a system's whole run) has no hook to report from."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EVERY_S = 15.0


@contextmanager
def ticking(
    log: Callable[[str], None], what: str, *, expected_s: float | None = None, every_s: float = EVERY_S
) -> Iterator[None]:
    began = time.perf_counter()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            elapsed = time.perf_counter() - began
            if expected_s:
                left = max(expected_s - elapsed, 0.0)
                log(f"    {what}: {elapsed:.0f} s so far, about {left:.0f} s left (as the last run took)")
            else:
                log(f"    {what}: {elapsed:.0f} s so far")

    thread = threading.Thread(target=tick, name="bench-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
