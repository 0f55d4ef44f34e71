"""The audit log: one row per change to what decides who may call which model and where its traffic goes,
whoever made it and by whatever path (the API, the dashboard, the admin, a command, the rollout judge).
Written by audit.log.record only, from the services every path calls; never edited afterwards.

The rollouts' own histories (registry.AliasEvent, rollouts.DeploymentEvent) stay as they are: they tell
one alias's or one deployment's story, this log tells everything, side by side."""

from __future__ import annotations

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.utils import timezone


class AuditEntry(models.Model):
    class ObjectType(models.TextChoices):
        MODEL = "model", "Model (ownership)"
        MODEL_VERSION = "model_version", "Model version"
        ALIAS = "alias", "Alias"
        ROUTING_TABLE = "routing_table", "Traffic (routing table, mirror)"
        DEPLOYMENT = "deployment", "Deployment"
        SCALING_BOUNDS = "scaling_bounds", "Scaling bounds"
        TENANT = "tenant", "Tenant"
        QUOTA = "quota", "Quota"
        API_KEY = "api_key", "API key"

    class Action(models.TextChoices):
        CREATE = "create"
        UPDATE = "update"
        DELETE = "delete"
        REVOKE = "revoke"

    at = models.DateTimeField(default=timezone.now, db_index=True)
    # Who: "staff:<user>" (API, dashboard, admin), "tenant:<name>" (API), "command:<name> (<os user>)",
    # "rollout-judge", or "system" for a caller that named no one.
    actor = models.CharField(max_length=200, db_index=True)
    object_type = models.CharField(max_length=32, choices=ObjectType.choices, db_index=True)
    object_id = models.CharField(max_length=200, help_text="The object's name: chat@stable, acme, sy-AbCdE…")
    action = models.CharField(max_length=16, choices=Action.choices)
    # What the object was and became, as audit.log.Snapshot keeps it (never a key or its hash); null
    # before a creation and after a deletion.
    before = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    after = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    reason = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.object_type} {self.object_id}"
