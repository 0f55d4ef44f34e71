from django.contrib import admin

from serving.models import ShadowDiffPair


@admin.register(ShadowDiffPair)
class ShadowDiffPairAdmin(admin.ModelAdmin):
    """Read-only, for staff: the shadow copies kept because their output differed from their primary's
    (already redacted; see serving/gateway/shadow_diff.py)."""

    list_display = ("id", "version", "primary_version", "first_divergence", "agreement", "created_at")
    list_filter = ("version__model__name",)
    search_fields = ("request_id",)

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return [f.name for f in ShadowDiffPair._meta.fields]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False
