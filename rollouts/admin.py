from django.contrib import admin

from registry.admin import MovesRoutingRevision
from rollouts import snapshots
from rollouts.models import Deployment, DeploymentEvent, ScaleTarget, ScalingBounds


class DeploymentEventInline(admin.TabularInline):
    model = DeploymentEvent
    extra = 0
    can_delete = False
    readonly_fields = ("at", "from_state", "to_state", "actor", "reason", "figures")

    def has_add_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    """Read-only: deployments change through the API (services), so every change leaves an event."""

    list_display = (
        "id",
        "model",
        "candidate",
        "incumbent",
        "strategy",
        "state",
        "current_step",
        "created_at",
    )
    list_filter = ("state", "strategy")
    inlines = [DeploymentEventInline]

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return [f.name for f in Deployment._meta.fields]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_delete_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        # Deleted in flight, its canary kept its alias and its share of the traffic with nothing left to
        # judge it, and its events (the audit trail) went with it. Roll it back through the API.
        return False


@admin.register(ScaleTarget)
class ScaleTargetAdmin(admin.ModelAdmin):
    """Read-only: the autoscaler writes the targets every tick (rollouts.scaling.autoscale)."""

    list_display = ("version", "replicas", "reason", "changed_at", "updated_at")

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return [f.name for f in ScaleTarget._meta.fields]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False


@admin.register(ScalingBounds)
class ScalingBoundsAdmin(MovesRoutingRevision):  # gateways route by them (whether a model scales to zero)
    audit_snapshot = staticmethod(snapshots.scaling_bounds)
    list_display = ("model", "min_replicas", "max_replicas", "updated_at")
