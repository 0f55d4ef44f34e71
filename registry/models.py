"""The registry: what can be served (models, immutable versions, aliases, routing) and who may call it
(tenants, API keys, quotas). Writes go through registry.services."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

NAME_VALIDATOR = RegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,62}\Z",  # \Z, not $: $ also matches before a final newline
    "Use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit.",
)


def is_valid_name(value: str) -> bool:
    """Whether a model, version or tenant could have this name. Checked before a lookup by a name from a
    URL or a body: no row can match one that is not, and Postgres refuses a NUL in a query (a 500)."""
    return NAME_VALIDATOR.regex.fullmatch(value) is not None


class Model(models.Model):
    class Kind(models.TextChoices):
        CAUSAL_LM = "causal-lm", "Causal language model"
        EMBEDDING = "embedding", "Embedding model"
        CLASSIFIER = "classifier", "Text classifier"

    name = models.CharField(max_length=63, unique=True, validators=[NAME_VALIDATOR])
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.CAUSAL_LM)
    description = models.TextField(blank=True)
    # The tenant whose model this is (its own fine-tune, say): the one tenant that sees, uses and deploys
    # it, unless a quota names it; none: the platform's, deployed by staff and by the tenants granted it
    # (Quota.deployable_models).
    owner = models.ForeignKey(
        "registry.Tenant", null=True, blank=True, on_delete=models.PROTECT, related_name="owned_models"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ModelVersion(models.Model):
    """An immutable artifact: once created, the fields that say what was registered never change."""

    IMMUTABLE_FIELDS = (
        "model_id",
        "version",
        "artifact_uri",
        "sha256",
        "format",
        "size_bytes",
        "files",
        # Lineage and who registered it when (docs/architecture.md, "The control plane"). The parent may still
        # become NULL when it is deleted (SET_NULL), which is an update, not a save.
        "parent_id",
        "adapter_of_id",
        "quantization",
        "created_by",
        "created_at",
    )

    class Format(models.TextChoices):
        SAFETENSORS = "safetensors", "safetensors"

    class Quantization(models.TextChoices):
        NONE = "", "none"
        INT8_WEIGHT = "int8-weight", "int8 weights"

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="versions")
    version = models.CharField(max_length=63, validators=[NAME_VALIDATOR])
    artifact_uri = models.CharField(max_length=1024)
    sha256 = models.CharField(max_length=64, help_text="Digest over every file's path and sha256.")
    format = models.CharField(max_length=16, choices=Format.choices, default=Format.SAFETENSORS)
    size_bytes = models.BigIntegerField()
    files = models.JSONField(help_text="Relative path -> sha256 of each file of the artifact.")
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children"
    )
    # A LoRA adapter's base (docs/architecture.md, "Adapters on a shared base"): its requests run on the
    # base's replicas, so the base cannot be deleted while an adapter names it.
    adapter_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="adapters"
    )
    quantization = models.CharField(max_length=16, choices=Quantization.choices, default="", blank=True)
    # Measured against the parent on held-out text ("Quantized siblings"): a measurement, not the artifact,
    # so it may be recorded after registration and is not among the immutable fields.
    quality = models.JSONField(default=dict, blank=True)
    created_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "version"], name="unique_model_version")]
        ordering = ["model__name", "created_at"]

    def __str__(self) -> str:
        return f"{self.model.name}:{self.version}"

    def save(self, *args: object, **kwargs: object) -> None:
        if self.pk is not None:
            stored = type(self).objects.filter(pk=self.pk).values(*self.IMMUTABLE_FIELDS).first()
            if stored is not None:
                changed = [f for f in self.IMMUTABLE_FIELDS if stored[f] != getattr(self, f)]
                if changed:
                    raise ValidationError(
                        f"model versions are immutable; refused change to {', '.join(changed)}"
                    )
        super().save(*args, **kwargs)  # type: ignore[arg-type]


class Alias(models.Model):
    """A movable name for a version (`chat-model@stable`). Every move is logged in AliasEvent."""

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="aliases")
    name = models.CharField(max_length=63, validators=[NAME_VALIDATOR])
    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="aliases")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "name"], name="unique_model_alias")]
        verbose_name_plural = "aliases"

    def __str__(self) -> str:
        return f"{self.model.name}@{self.name}"


class AliasEvent(models.Model):
    alias = models.ForeignKey(Alias, on_delete=models.CASCADE, related_name="events")
    from_version = models.ForeignKey(
        ModelVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    to_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    actor = models.CharField(max_length=150)
    reason = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.alias}: {self.from_version} -> {self.to_version} by {self.actor}"


class RoutingTable(models.Model):
    """How a model's traffic splits over its versions. `revision` grows on every change so that
    gateways can tell cheaply whether their cached copy is stale."""

    model = models.OneToOneField(Model, on_delete=models.CASCADE, related_name="routing_table")
    revision = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)
    # Shadow traffic: this share of the requests served by other versions is copied to mirror_version,
    # whose output is discarded (a shadow deployment sets and clears it).
    mirror_version = models.ForeignKey(
        ModelVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    mirror_pct = models.PositiveSmallIntegerField(default=0, validators=[MaxValueValidator(100)])

    def __str__(self) -> str:
        return f"routing for {self.model.name} (rev {self.revision})"


class RoutingEntry(models.Model):
    table = models.ForeignKey(RoutingTable, on_delete=models.CASCADE, related_name="entries")
    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="routing_entries")
    weight = models.PositiveSmallIntegerField(validators=[MinValueValidator(0)])

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["table", "version"], name="unique_routing_entry"),
            models.CheckConstraint(condition=models.Q(weight__lte=100), name="routing_weight_lte_100"),
        ]
        verbose_name_plural = "routing entries"

    def __str__(self) -> str:
        return f"{self.version}: {self.weight}%"


class Tenant(models.Model):
    name = models.CharField(max_length=63, unique=True, validators=[NAME_VALIDATOR])
    is_active = models.BooleanField(default=True)
    # Tenants in the same group may share prefix-cache blocks; by default each tenant is alone.
    prefix_cache_group = models.CharField(max_length=63, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    """Only a SHA-256 of the key and its first characters are stored; the key is shown once."""

    PREFIX_LENGTH = 8

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=63, blank=True)
    prefix = models.CharField(max_length=PREFIX_LENGTH, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant.name})"


class ServiceTier(models.TextChoices):
    """OpenAI's service_tier values this platform serves, highest first (docs/api.md, "Service tiers"):
    a replica admits waiting requests by tier, with aging, and preempts the lowest first."""

    PRIORITY = "priority"
    DEFAULT = "default"
    FLEX = "flex"

    @classmethod
    def rank(cls, tier: str) -> int:
        """0 for the highest tier: the order a replica's scheduler admits in."""
        return [cls.PRIORITY, cls.DEFAULT, cls.FLEX].index(cls(tier))


class Quota(models.Model):
    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    requests_per_second = models.FloatField(default=10.0, validators=[MinValueValidator(0.0)])
    tokens_per_minute = models.PositiveIntegerField(default=100_000)
    max_concurrent_requests = models.PositiveIntegerField(default=16)
    allowed_models = models.ManyToManyField(
        Model,
        blank=True,
        related_name="+",
        help_text="Empty means every model but other tenants' own (Model.owner).",
    )
    may_pin = models.BooleanField(default=False, help_text="May choose a version with X-Version-Pin.")
    may_deploy = models.BooleanField(default=False, help_text="May roll out its own models (Model.owner).")
    deployable_models = models.ManyToManyField(
        Model,
        blank=True,
        related_name="+",
        help_text="Platform models (no owner) it may roll out too, with may_deploy: a rollout moves the "
        "traffic of every tenant they serve, so each is an explicit grant.",
    )
    max_service_tier = models.CharField(
        max_length=16,
        choices=ServiceTier.choices,
        default=ServiceTier.DEFAULT,
        help_text="The highest service_tier its requests may ask for.",
    )
    ttft_objective_ms = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],  # 0 ms: no request could ever start in time
        help_text="Its p99 time-to-first-token objective: a request the fleet cannot start in time is "
        "refused at once with a Retry-After (empty: none).",
    )
    tpot_objective_ms = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Its time-per-output-token objective (empty: none).",
    )
    max_running_sequences = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="The most of its sequences one replica runs at once (empty: no cap of its own).",
    )
    kv_share = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.01), MaxValueValidator(1.0)],
        help_text="The share of a replica's KV-cache blocks its sequences may hold (empty: no cap).",
    )

    def __str__(self) -> str:
        return f"quota for {self.tenant.name}"
