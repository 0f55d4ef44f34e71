"""Celery tasks of the rollouts. Thin: load rows, call the service of the same name.

Production runs them from `celery -A config beat` (schedule: settings.CELERY_BEAT_SCHEDULE); the embedded
mode runs the same functions on the same schedule (config.periodic)."""

from __future__ import annotations

import logging

from celery import shared_task
from django.db import IntegrityError

from rollouts import judge_lease, judge_tick, scaling, selectors
from serving.selectors import HeartbeatsUnavailable

logger = logging.getLogger(__name__)


@shared_task(name="rollouts.tasks.rollout_judge_tick", ignore_result=True)
def rollout_judge_tick() -> int:
    """One judge tick for every deployment in flight; returns how many were judged. One deployment that
    fails does not stop the others. Not while another process holds the judge's lease
    (rollouts/judge_lease.py): it judges them."""
    if not judge_lease.acquire():
        logger.debug("rollout judge: %s holds the lease; not judging", judge_lease.held_by_another())
        return 0
    num_judged = 0
    for deployment_id in selectors.deployment_ids_to_judge():
        deployment = selectors.deployment_get(deployment_id=deployment_id, with_events=False)
        if deployment is None:
            continue
        try:
            judge_tick.deployment_judge(deployment=deployment)
        except Exception:
            logger.exception("rollout judge: deployment %s failed this tick", deployment_id)
            continue
        num_judged += 1
    return num_judged


@shared_task(name="rollouts.tasks.autoscaler_tick", ignore_result=True)
def autoscaler_tick() -> int:
    """One autoscaler tick (rollouts.scaling.autoscale); returns how many targets changed. Heartbeats
    that cannot be read change nothing."""
    try:
        return len(scaling.autoscale())
    except HeartbeatsUnavailable as exc:
        logger.warning("autoscaler: holding every target: %s", exc)
    except IntegrityError:  # another tick created a version's first row meanwhile: the next tick reads it
        logger.info("autoscaler: a concurrent tick wrote first; this one is dropped")
    return 0
