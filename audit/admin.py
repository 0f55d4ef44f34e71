from django.contrib import admin

from audit.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    """Read-only: the log is written by the services alone, and an entry edited or deleted here would
    be a record no one can trust."""

    list_display = ("at", "actor", "action", "object_type", "object_id", "reason")
    list_filter = ("object_type", "action")
    search_fields = ("actor", "object_id")
    date_hierarchy = "at"

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return [f.name for f in AuditEntry._meta.fields]

    def has_add_permission(self, request):  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False

    def has_delete_permission(self, request, obj=None):  # type: ignore[no-untyped-def]
        return False
