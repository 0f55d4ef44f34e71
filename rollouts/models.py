"""Deployments of a candidate version against the incumbent, and the log of every transition.
Writes go through rollouts.services (create, rollback, promote) and rollouts.judge_tick (the judge's tick)."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from registry.models import Model, ModelVersion


class Deployment(models.Model):
    class Strategy(models.TextChoices):
        CANARY = "canary", "Canary (stepped traffic split)"
        SHADOW = "shadow", "Shadow (mirrored traffic, output discarded)"

    class State(models.TextChoices):
        PENDING = "pending"
        PROVISIONING = "provisioning"
        RAMPING = "ramping"  # canary: taking the current step's share of traffic
        SHADOWING = "shadowing"  # shadow: receiving mirrored traffic
        PROMOTED = "promoted"
        COMPLETED = "completed"  # shadow: ran its window healthy; traffic never moved
        ROLLING_BACK = "rolling_back"
        ROLLED_BACK = "rolled_back"

    # At most one of these per model (a partial unique constraint below keeps it so under races).
    IN_FLIGHT_STATES = (
        State.PENDING,
        State.PROVISIONING,
        State.RAMPING,
        State.SHADOWING,
        State.ROLLING_BACK,
    )

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="deployments")
    candidate = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="deployments")
    incumbent = models.ForeignKey(
        ModelVersion, on_delete=models.PROTECT, related_name="+", help_text="The stable version at creation."
    )
    strategy = models.CharField(max_length=16, choices=Strategy.choices, default=Strategy.CANARY)
    steps = models.JSONField(help_text='Canary: [{"pct": 1}, ..., {"pct": 100}], strictly increasing.')
    mirror_pct = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        help_text="Shadow: share of the incumbent's requests mirrored to the candidate.",
    )
    current_step = models.PositiveSmallIntegerField(default=0)
    bake_seconds = models.PositiveIntegerField()
    thresholds = models.JSONField(help_text="Resolved at creation: settings defaults plus overrides.")
    # How good the candidate's recorded evaluation against its parent must be before a canary advances
    # (rollouts/quality_floor.py): min_greedy_agreement, max_perplexity_increase; {}: no floor.
    quality_floor = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING, db_index=True)
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)
    provisioning_started_at = models.DateTimeField(null=True, blank=True)
    step_started_at = models.DateTimeField(null=True, blank=True)
    # Looks at the current step that ran the judge's tests (a tick short of min_samples is none): the
    # judge spends the step's alpha per look, so ticks that only waited for data must not use it up.
    step_looks = models.PositiveIntegerField(default=0)
    last_judged_at = models.DateTimeField(null=True, blank=True)
    last_verdict = models.JSONField(default=dict, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Rollback timings: when it was decided, how long the routing edit took inside the transaction, and
    # when the transaction committed (from then on every gateway sees the new table within its
    # revalidation interval).
    rollback_decided_at = models.DateTimeField(null=True, blank=True)
    rollback_edit_ms = models.FloatField(null=True, blank=True)
    rollback_committed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["model"],
                condition=models.Q(
                    state__in=["pending", "provisioning", "ramping", "shadowing", "rolling_back"]
                ),
                name="one_in_flight_deployment_per_model",
            )
        ]

    def __str__(self) -> str:
        return f"deployment {self.pk}: {self.model.name} {self.candidate.version} ({self.state})"

    @property
    def is_in_flight(self) -> bool:
        return self.state in self.IN_FLIGHT_STATES

    @property
    def current_pct(self) -> int:
        """The candidate's share of traffic in the current state."""
        if self.state == self.State.PROMOTED:
            return 100
        if self.state != self.State.RAMPING or not self.steps:
            return 0
        return int(self.steps[self.current_step]["pct"])


class DeploymentEvent(models.Model):
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    from_state = models.CharField(max_length=16, blank=True)
    to_state = models.CharField(max_length=16)
    actor = models.CharField(max_length=150)
    reason = models.TextField()
    figures = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.deployment_id}: {self.from_state or '-'} -> {self.to_state} ({self.reason[:60]})"


class ScaleTarget(models.Model):
    """How many replicas a model version should have: the autoscaler's decision (rollouts.fleet.autoscaler),
    which the provisioners carry out. One row per version the autoscaler has seen."""

    version = models.OneToOneField(ModelVersion, on_delete=models.CASCADE, related_name="scale_target")
    replicas = models.PositiveSmallIntegerField()
    reason = models.TextField(blank=True, help_text="The signal that decided the last recommendation.")
    signals = models.JSONField(default=dict, blank=True, help_text="The figures it was made from.")
    # [[unix time, replicas], ...] of the scale-down window: the target never falls below any of them.
    recommendations = models.JSONField(default=list, blank=True)
    changed_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.version}: {self.replicas} replica(s)"


class ScalingBounds(models.Model):
    """A model's own replica bounds, over the autoscaler's defaults (settings.AUTOSCALER): each of its
    serving versions gets between min_replicas and max_replicas. min_replicas 0: an idle version scales to
    zero, and a request for it waits at the gateway while a replica starts. Set with `manage.py
    set_scaling`."""

    model = models.OneToOneField(Model, on_delete=models.CASCADE, related_name="scaling_bounds")
    min_replicas = models.PositiveSmallIntegerField()
    max_replicas = models.PositiveSmallIntegerField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(max_replicas__gte=1)
                & models.Q(max_replicas__gte=models.F("min_replicas")),
                name="scaling_bounds_in_order",
            )
        ]

    def __str__(self) -> str:
        return f"{self.model.name}: {self.min_replicas}-{self.max_replicas} replicas"


class JudgeLease(models.Model):
    """Who runs the rollout judge, and until when (rollouts/judge_lease.py): one row. Each tick renews
    it for its holder, or takes it once it has run out; a second process judging the same database (a
    `demo_rollout` beside `make serve`, two embedded servers) skips its ticks instead of judging every
    deployment twice. Celery's workers share one holder, "celery": beat sends each tick once."""

    holder = models.CharField(max_length=200)
    until = models.DateTimeField()

    def __str__(self) -> str:
        return f"judge lease: {self.holder} until {self.until:%H:%M:%S}"
