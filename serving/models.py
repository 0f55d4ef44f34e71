"""The metrics store: one row per model version, replica and window. Writes in serving.telemetry.metrics_store
(flush, roll-up, retention), reads in serving.telemetry.metrics_reads (rows of every replica merged)."""

from __future__ import annotations

from datetime import timedelta

from django.db import models

from registry.models import ModelVersion


class MetricWindow(models.Model):
    """Histograms, counters and gauges of one replica over one window.

    5 s rows come from replicas' flushes and are kept FINE_RETENTION; every minute of them is rolled
    up into one 60 s row merged over replicas (replica_id "") and kept COARSE_RETENTION."""

    FINE_RESOLUTION_S = 5
    COARSE_RESOLUTION_S = 60
    FINE_RETENTION = timedelta(hours=24)
    COARSE_RETENTION = timedelta(days=30)

    class Resolution(models.IntegerChoices):
        FINE = 5, "5 s"
        COARSE = 60, "1 min"

    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="metric_windows")
    replica_id = models.CharField(max_length=64, blank=True, help_text="Empty on rows merged over replicas.")
    start = models.DateTimeField(help_text="UTC, aligned to the resolution.")
    resolution_s = models.PositiveSmallIntegerField(choices=Resolution.choices)
    histograms = models.JSONField(default=dict)
    counters = models.JSONField(default=dict)
    gauges = models.JSONField(default=dict)
    # On 5 s rows: False when the row changed since its minute was last rolled up.
    is_rolled_up = models.BooleanField(default=False)

    class Meta:
        constraints = [
            # Its index also serves reads by (version, resolution, start range).
            models.UniqueConstraint(
                fields=["version", "resolution_s", "start", "replica_id"], name="unique_metric_window"
            )
        ]
        indexes = [
            models.Index(fields=["resolution_s", "is_rolled_up", "start"], name="metric_window_rollup"),
            models.Index(fields=["resolution_s", "start"], name="metric_window_retention"),
        ]
        ordering = ["start"]

    def __str__(self) -> str:
        return (
            f"{self.version_id} {self.replica_id or '*'} {self.start:%Y-%m-%dT%H:%M:%S} /{self.resolution_s}s"
        )


class ShadowDiffPair(models.Model):
    """A shadow copy whose output differed from its primary's, kept with both outputs and the input, all
    redacted as the prompt log redacts them (serving/telemetry/prompt_log.py). Kept only while prompt
    logging is on (settings.LOG_PROMPTS_SAMPLE_RATE > 0: that share of differing copies is drawn), up to
    settings.SHADOW_DIFF_PAIRS per candidate version: staff read them in the admin and on the
    deployment's page of the dashboard (serving/telemetry/shadow_pairs.py)."""

    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="shadow_diff_pairs")
    primary_version = models.CharField(max_length=63)
    request_id = models.CharField(max_length=64)
    input = models.JSONField(help_text="Redacted, as the prompt log writes it.")
    primary_output = models.TextField(help_text="Redacted.")
    candidate_output = models.TextField(help_text="Redacted.")
    first_divergence = models.PositiveIntegerField(
        null=True, help_text="Index of the first token that differs; empty when only the text differs."
    )
    agreement = models.FloatField(help_text="Share of the shorter output's positions that agree.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["version", "created_at"], name="shadow_diff_pair_version")]

    def __str__(self) -> str:
        return f"{self.version_id} {self.request_id} diverged at {self.first_divergence}"
