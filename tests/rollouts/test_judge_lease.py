"""One judge per database (rollouts/judge_lease.py): a tick runs only for the lease's holder; another
process takes over once the lease runs out; a deployment that no judge moves says what it waits on; and
demo_rollout will not race a server's judge."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from rollouts import judge_lease, selectors, services, tasks
from rollouts.models import Deployment

pytestmark = pytest.mark.django_db

NOW = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)


def test_one_holder_at_a_time_until_its_lease_runs_out() -> None:
    assert judge_lease.acquire(holder="server-a", now=NOW)
    assert not judge_lease.acquire(holder="demo-b", now=NOW + dt.timedelta(seconds=1))
    assert judge_lease.held_by_another(holder="demo-b", now=NOW) == "server-a"
    assert judge_lease.acquire(holder="server-a", now=NOW + dt.timedelta(seconds=5))  # renewed
    later = NOW + dt.timedelta(seconds=5 + judge_lease.lease_s() + 1)  # server-a stopped ticking
    assert judge_lease.acquire(holder="demo-b", now=later)
    judge_lease.release(holder="demo-b")
    assert judge_lease.acquire(holder="server-a")  # given up: taken at once


def test_a_tick_judges_only_while_this_process_holds_the_lease(make_model) -> None:  # type: ignore[no-untyped-def]
    deployment = services.deployment_create(model=make_model(), version="v2", created_by="staff:bob")
    assert judge_lease.acquire(holder="another-server")
    assert tasks.rollout_judge_tick() == 0
    assert Deployment.objects.get(pk=deployment.pk).state == "provisioning"  # not judged
    judge_lease.release(holder="another-server")
    assert tasks.rollout_judge_tick() == 1
    assert Deployment.objects.get(pk=deployment.pk).state == "ramping"  # its candidate ready: judged on


def test_a_deployment_no_judge_moves_says_what_it_waits_on(make_model) -> None:  # type: ignore[no-untyped-def]
    deployment = services.deployment_create(model=make_model(), version="v2", created_by="staff:bob")
    assert selectors.deployment_detail(deployment=deployment)["waiting_on"] is None  # just made
    Deployment.objects.filter(pk=deployment.pk).update(created_at=timezone.now() - dt.timedelta(minutes=5))
    waiting = selectors.deployment_detail(deployment=Deployment.objects.get(pk=deployment.pk))["waiting_on"]
    assert waiting.startswith("no rollout judge has run on this database for 30")
    assert "celery -A config worker" in waiting and "celery -A config beat" in waiting
    assert tasks.rollout_judge_tick() == 1  # a judge ticks: nothing missing
    assert (
        selectors.deployment_detail(deployment=Deployment.objects.get(pk=deployment.pk))["waiting_on"] is None
    )


@pytest.mark.django_db(transaction=True)  # the command reads on a thread of its own: committed rows
def test_demo_rollout_stops_while_another_process_judges_this_database() -> None:
    assert judge_lease.acquire(holder="make-serve:4242")
    with pytest.raises(CommandError, match=r"another process judges .*make-serve:4242.*SWITCHYARD_STATE_DIR"):
        call_command("demo_rollout")
