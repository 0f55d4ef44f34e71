"""Periodic tasks of the data plane (Celery beat in production, the embedded scheduler otherwise)."""

from celery import shared_task

from serving.telemetry.metrics_store import metrics_maintain


@shared_task(name="serving.tasks.metrics_maintain_tick", ignore_result=True)
def metrics_maintain_tick() -> None:
    metrics_maintain()
