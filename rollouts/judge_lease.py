"""The rollout judge's lease: one process judges a database's deployments at a time (JudgeLease).

A tick takes or renews the lease for LEASE_TICKS judge intervals and runs only if it holds it. A
holder that stops ticking (a server stopped, a crashed worker) loses it when it runs out, so another
takes over within that time. Who holds it also tells a deployment's status whether any judge runs at
all (rollouts/selectors.py, `waiting_on`): docs/architecture.md, "One judge per database"."""

from __future__ import annotations

import datetime as dt
import os
import socket

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from rollouts.models import JudgeLease

LEASE_TICKS = 3
CELERY = "celery"  # Celery's workers, whichever runs a tick: beat sends each one once
LEASE_ID = 1

_holder = CELERY


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def judge_here() -> None:
    """This process runs its own judge (the embedded scheduler, demo_rollout): it holds the lease as
    itself, not as Celery."""
    global _holder
    _holder = this_process()


def holder() -> str:
    return _holder


def lease_s() -> float:
    return LEASE_TICKS * settings.ROLLOUT_JUDGE_INTERVAL_S


def acquire(*, holder: str | None = None, now: dt.datetime | None = None) -> bool:
    """Take or renew the lease; False while another holder's has not run out."""
    holder = holder or _holder
    now = now or timezone.now()
    until = now + dt.timedelta(seconds=lease_s())
    # One query a tick once the row exists: the update is the test (held by us, or run out).
    taken = JudgeLease.objects.filter(pk=LEASE_ID).filter(Q(holder=holder) | Q(until__lt=now))
    if taken.update(holder=holder, until=until) == 1:
        return True
    if JudgeLease.objects.filter(pk=LEASE_ID).exists():
        return False  # another holder's lease runs
    try:
        with transaction.atomic():
            JudgeLease.objects.create(pk=LEASE_ID, holder=holder, until=until)
        return True
    except IntegrityError:  # another process made it meanwhile: take it as any other
        return taken.update(holder=holder, until=until) == 1


def held_by_another(*, holder: str | None = None, now: dt.datetime | None = None) -> str | None:
    """The other holder whose lease runs now, if any."""
    lease = JudgeLease.objects.filter(pk=LEASE_ID).first()
    if lease is None or lease.holder == (holder or _holder) or lease.until < (now or timezone.now()):
        return None
    return lease.holder


def last_judged(*, now: dt.datetime | None = None) -> dt.datetime | None:
    """When a judge last ticked, as far as its lease says (its last renewal); None: never. A lease still
    running: now."""
    lease = JudgeLease.objects.filter(pk=LEASE_ID).first()
    if lease is None:
        return None
    now = now or timezone.now()
    renewed = lease.until - dt.timedelta(seconds=lease_s())
    return now if lease.until >= now else renewed


def release(*, holder: str | None = None) -> None:
    """Give it up (a process that stops judging), so that another need not wait for it to run out."""
    JudgeLease.objects.filter(pk=LEASE_ID, holder=holder or _holder).update(until=timezone.now())


def is_running(*, now: dt.datetime | None = None) -> bool:
    """Whether some process's judge holds the lease now."""
    return JudgeLease.objects.filter(pk=LEASE_ID, until__gte=now or timezone.now()).exists()


MISSING_JUDGE = (
    "It runs in the server process in the embedded mode (`manage.py serve`), and in Celery with Redis: "
    "start `celery -A config worker` and `celery -A config beat`"
)


def missing_judge(*, since: dt.datetime, now: dt.datetime | None = None) -> str | None:
    """What an in-flight deployment made at `since` waits on when no judge ticks: a line naming the
    missing piece; None while one does (or has not been missing for a whole lease yet)."""
    now = now or timezone.now()
    judged = last_judged(now=now)
    if judged == now:
        return None
    idle_s = (now - (max(since, judged) if judged is not None else since)).total_seconds()
    if idle_s <= lease_s():
        return None
    return f"no rollout judge has run on this database for {idle_s:.0f} s. {MISSING_JUDGE}"
