"""The registry's admin pages. Every change made here that the audit log covers is recorded once, with the
staff user as the actor: edits the admin makes itself by AuditedAdmin, key revocations by the service."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin
from django.db import transaction

from audit import actors
from audit.log import Action, Snapshot, record
from registry import quotas, snapshots
from registry.models import (
    Alias,
    AliasEvent,
    ApiKey,
    Model,
    ModelVersion,
    Quota,
    RoutingEntry,
    RoutingTable,
    Tenant,
)
from registry.services import api_keys_revoke, routing_changed


class AuditedAdmin(admin.ModelAdmin):
    """For rows the admin writes itself rather than through a service: each save and deletion here is
    recorded in the audit log, once, in its transaction, with the row as stored before and after it
    (`audit_snapshot`). A save that changed nothing the snapshot keeps records nothing."""

    audit_snapshot: Callable[[Any], Snapshot]

    def save_model(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        with transaction.atomic():
            stored = type(obj).objects.filter(pk=obj.pk).first() if change else None
            before = type(self).audit_snapshot(stored) if stored is not None else None
            self.save_row(request, obj, form, change)
            self.after_write(obj)
            action = Action.UPDATE if before is not None else Action.CREATE
            after = type(self).audit_snapshot(obj)
            record(actor=actors.staff(request.user), action=action, before=before, after=after)

    def save_row(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        super().save_model(request, obj, form, change)

    def after_write(self, obj: Any) -> None:
        """What else a save or deletion of `obj` must do, in its transaction."""

    def delete_model(self, request, obj):  # type: ignore[no-untyped-def]
        with transaction.atomic():
            before = type(self).audit_snapshot(obj)
            super().delete_model(request, obj)
            self.after_write(obj)
            record(actor=actors.staff(request.user), action=Action.DELETE, before=before, after=None)

    def delete_queryset(self, request, queryset):  # type: ignore[no-untyped-def]
        with transaction.atomic():
            rows = list(queryset)
            befores = [type(self).audit_snapshot(row) for row in rows]
            super().delete_queryset(request, queryset)
            for row, before in zip(rows, befores, strict=True):
                self.after_write(row)
                record(actor=actors.staff(request.user), action=Action.DELETE, before=before, after=None)


class MovesRoutingRevision(AuditedAdmin):
    """For rows a gateway routes a model by (its table, an alias, its scaling bounds): gateways keep a
    model's routing until its revision moves, so every save or deletion here moves it, as the services
    do for every other routing edit. The row's `model` names the model."""

    def after_write(self, obj: Any) -> None:
        routing_changed(model=obj.model)


@admin.register(Model)
class ModelAdmin(AuditedAdmin):  # its owner: who sees, uses and deploys it
    audit_snapshot = staticmethod(snapshots.model)
    list_display = ("name", "kind", "owner", "created_at")

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        # Metrics, heartbeats and replicas are keyed by the name, and gateways route by the kind they
        # read with the model's routing: renamed, an in-flight judge read empty windows; a kind changed
        # here skipped registration's one-kind-per-model rule and left gateways on the old one.
        return ("name", "kind") if obj else ()


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    list_display = ("model", "version", "sha256", "size_bytes", "created_by", "created_at")
    list_filter = ("model",)

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        # Versions are immutable: registered with `manage.py register_model`, never edited here.
        return [f.name for f in self.model._meta.fields] if obj else []

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False


class AliasEventInline(admin.TabularInline):
    model = AliasEvent
    fk_name = "alias"
    extra = 0
    can_delete = False
    readonly_fields = ("from_version", "to_version", "actor", "reason", "created_at")


@admin.register(Alias)
class AliasAdmin(MovesRoutingRevision):
    audit_snapshot = staticmethod(snapshots.alias)
    list_display = ("__str__", "version", "updated_at")
    readonly_fields = ("model", "name", "version")
    inlines = [AliasEventInline]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        # Every field is read-only here, so an add form could only fail (a 500 on its empty row); aliases
        # are set by registration and by rollouts, each move with its event logged.
        return False


class RoutingEntryInline(admin.TabularInline):
    model = RoutingEntry
    extra = 0
    readonly_fields = ("version", "weight")
    can_delete = False


class RoutingTableForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = RoutingTable
        fields = ("mirror_version", "mirror_pct")  # the rest is read-only (RoutingTableAdmin)

    def clean_mirror_version(self):  # type: ignore[no-untyped-def]
        # As routing_mirror_set checks: gateways keep only the version's name, so another model's "v2"
        # would mirror to this model's "v2", while replicas were started for the other's.
        version = self.cleaned_data.get("mirror_version")
        if version is not None and version.model_id != self.instance.model_id:
            raise forms.ValidationError("The mirror must be a version of this model.")
        return version


@admin.register(RoutingTable)
class RoutingTableAdmin(MovesRoutingRevision):  # its mirror (a shadow deployment's) is editable
    audit_snapshot = staticmethod(lambda table: snapshots.routing_table(table.model))
    form = RoutingTableForm
    list_display = ("model", "revision", "updated_at")

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False  # a model's table comes with the model (its model field is read-only here)

    def has_delete_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        # With its entries gone, gateways fall back to @stable, and the next version registered is taken
        # for the model's first: all of the traffic and the stable alias, with no canary.
        return False

    readonly_fields = ("model", "revision")
    inlines = [RoutingEntryInline]

    def save_row(self, request, obj, form, change):  # type: ignore[no-untyped-def]
        if not change:
            super().save_row(request, obj, form, change)
            return
        # Not the revision read with the form: a routing edit committed meanwhile moved it, and writing
        # it back would let the bump after this save land on a revision gateways hold.
        fields = [f for f in form.changed_data if f != "revision"]
        if fields:
            obj.save(update_fields=[*fields, "updated_at"])


class QuotaForm(forms.ModelForm):  # type: ignore[type-arg]
    """A quota's settings keep the rules the services apply (registry.quotas), each refusal shown at its
    field: the same values are refused here as by the API and the commands."""

    class Meta:
        model = Quota
        fields = (*quotas.SETTINGS, "allowed_models", "deployable_models")
        labels = {
            "max_service_tier": "Highest service tier",
            "ttft_objective_ms": "TTFT objective (p99, ms)",
            "tpot_objective_ms": "TPOT objective (ms)",
            "max_running_sequences": "Running sequences per replica",
            "kv_share": "KV-cache share per replica",
        }

    def clean(self):  # type: ignore[no-untyped-def]
        cleaned = super().clean()
        for name in quotas.SETTINGS:
            if name in cleaned and name not in self.errors:
                problem = quotas.problem(name, cleaned[name])
                if problem is not None:
                    self.add_error(name, problem)
        return cleaned


class QuotaInline(admin.StackedInline):
    model = Quota
    form = QuotaForm
    can_delete = False
    fieldsets = (
        (None, {"fields": ("requests_per_second", "tokens_per_minute", "max_concurrent_requests")}),
        ("Models", {"fields": ("allowed_models", "may_pin", "may_deploy", "deployable_models")}),
        (
            "Service tier and latency objectives",
            {"fields": ("max_service_tier", "ttft_objective_ms", "tpot_objective_ms")},
        ),
        (
            "Caps inside each replica",
            {
                "fields": ("max_running_sequences", "kv_share"),
                "description": "Empty: the replica's own SWITCHYARD_MAX_RUNNING_PER_TENANT and "
                "SWITCHYARD_MAX_KV_SHARE_PER_TENANT apply, if set.",
            },
        ),
    )


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin):
    audit_snapshot = staticmethod(snapshots.tenant)
    list_display = ("name", "is_active", "created_at")
    inlines = [QuotaInline]

    def save_related(self, request, form, formsets, change):  # type: ignore[no-untyped-def]
        """The quota, edited inline: recorded as a change of its own (it may change alone)."""
        with transaction.atomic():
            stored = Quota.objects.filter(tenant=form.instance).first()
            before = snapshots.quota(stored) if stored is not None else None
            super().save_related(request, form, formsets, change)
            quota = Quota.objects.filter(tenant=form.instance).first()
            if quota is not None:
                action = Action.UPDATE if before is not None else Action.CREATE
                after = snapshots.quota(quota)
                record(actor=actors.staff(request.user), action=action, before=before, after=after)


@admin.register(ApiKey)
class ApiKeyAdmin(AuditedAdmin):  # its name here; deleted here; revoked through the service
    audit_snapshot = staticmethod(snapshots.api_key)
    list_display = ("prefix", "tenant", "name", "created_at", "last_used_at", "revoked_at")
    # A revocation is one-way: cleared here, a leaked key would come back with no record of it.
    readonly_fields = ("tenant", "prefix", "key_hash", "created_at", "last_used_at", "revoked_at")
    actions = ["revoke"]

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset):  # type: ignore[no-untyped-def]
        revoked = api_keys_revoke(api_keys=list(queryset), actor=actors.staff(request.user))
        self.message_user(request, f"{len(revoked)} key(s) revoked")

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False  # keys are created with `manage.py create_api_key`, which shows the key once
