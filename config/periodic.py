"""The embedded scheduler: Celery beat's job inside the server process when there is no Redis.

`run_periodic_tasks(settings.CELERY_BEAT_SCHEDULE)` runs each entry's task function (the same Celery
task object a worker would run, called in-process) every `schedule` seconds on a one-thread executor,
so the event loop never blocks on the database. A run that overruns its period delays the next one
rather than piling runs up; a run that raises is logged and the schedule goes on. Beat reads the same
mapping (config/celery.py), so there is one schedule: tests/e2e/test_celery_live.py compares what each
runs. (Celery's own `worker -B` on a memory:// broker never runs periodic tasks: docs/architecture.md,
"The embedded periodic scheduler".)"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from django.db import close_old_connections

from rollouts import judge_lease

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PeriodicEntry:
    name: str
    task_name: str
    interval_s: float
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def interval_seconds(schedule: object) -> float:
    """Seconds between runs for the schedule forms beat accepts that have a fixed period."""
    if isinstance(schedule, bool):
        raise ValueError("a schedule must be seconds, a timedelta or a celery schedule")
    if isinstance(schedule, int | float):
        seconds = float(schedule)
    elif isinstance(schedule, dt.timedelta):
        seconds = schedule.total_seconds()
    elif isinstance(getattr(schedule, "run_every", None), dt.timedelta):
        seconds = schedule.run_every.total_seconds()  # type: ignore[attr-defined]
    else:
        raise ValueError(f"the embedded scheduler runs fixed intervals only, not {schedule!r}")
    if seconds <= 0:
        raise ValueError(f"a schedule's interval must be positive, got {seconds}")
    return seconds


def parse_schedule(schedule: Mapping[str, Mapping[str, Any]]) -> list[PeriodicEntry]:
    entries = []
    for name, spec in schedule.items():
        entries.append(
            PeriodicEntry(
                name=name,
                task_name=str(spec["task"]),
                interval_s=interval_seconds(spec["schedule"]),
                args=tuple(spec.get("args", ())),
                kwargs=dict(spec.get("kwargs", {})),
            )
        )
    return entries


def resolve_task(task_name: str) -> Any:
    """The registered Celery task of that name (task modules are imported first, as a worker would)."""
    # Deferred: the Celery app is only needed to resolve a task by name, and importing it configures
    # Celery for the whole process (the embedded scheduler runs without it).
    from config.celery import app

    app.loader.import_default_modules()
    try:
        return app.tasks[task_name]
    except KeyError:
        raise LookupError(f"no Celery task named {task_name!r}") from None


def _run_task(task: Any, entry: PeriodicEntry) -> Any:
    close_old_connections()  # as a Celery worker does around each task
    try:
        return task(*entry.args, **entry.kwargs)
    finally:
        close_old_connections()


async def _run_entry(entry: PeriodicEntry, executor: ThreadPoolExecutor) -> None:
    loop = asyncio.get_running_loop()
    try:
        task = await loop.run_in_executor(executor, resolve_task, entry.task_name)
    except LookupError:
        logger.exception("embedded scheduler: %s is not scheduled", entry.name)
        return
    next_run = time.monotonic() + entry.interval_s
    while True:
        await asyncio.sleep(max(0.0, next_run - time.monotonic()))
        started = time.monotonic()
        try:
            await loop.run_in_executor(executor, _run_task, task, entry)
        except Exception:
            logger.exception("embedded scheduler: %s (%s) failed", entry.name, entry.task_name)
        # Keep the cadence; after an overrun, run once at once and then resume it.
        next_run = max(next_run + entry.interval_s, started)


async def run_periodic_tasks(schedule: Mapping[str, Mapping[str, Any]]) -> None:
    """Run every entry of a beat schedule forever (cancel the task to stop). Start it once per server
    process, on the server's loop, and only when no Celery beat runs (settings.REDIS_URL unset)."""
    entries = parse_schedule(schedule)
    if not entries:
        return
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedded-beat")
    tasks = [asyncio.create_task(_run_entry(e, executor), name=f"beat-{e.name}") for e in entries]
    logger.info(
        "embedded scheduler: %s", ", ".join(f"{e.task_name} every {e.interval_s:g} s" for e in entries)
    )
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        executor.shutdown(wait=False, cancel_futures=True)


_embedded: asyncio.Task[None] | None = None


def start_embedded_scheduler() -> asyncio.Task[None] | None:
    """Start the beat schedule in this process, once, on the running loop; a second call returns the same
    task. Does nothing (None) when settings.REDIS_URL is set: then Celery beat and workers run it, and a
    second scheduler would judge every deployment twice per period. For the `serve` command's on_ready."""
    from django.conf import settings

    global _embedded
    if settings.REDIS_URL:
        return None
    if _embedded is None or _embedded.done():
        judge_lease.judge_here()  # this process's judge, not Celery's: its own lease (one per database)
        _embedded = asyncio.get_running_loop().create_task(
            run_periodic_tasks(settings.CELERY_BEAT_SCHEDULE), name="embedded-beat"
        )
    return _embedded
