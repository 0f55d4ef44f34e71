import argparse

from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.management.quota_flags import add_policy_flags, given_settings
from registry.models import Tenant, is_valid_name
from registry.quotas import SETTINGS, QuotaChange
from registry.services import RegistryError, quota_set


class Command(BaseCommand):
    help = (
        "Change a tenant's quota: the settings named change, the others stay (`none` empties an objective "
        "or a cap). Models it may use or deploy: the admin, or PATCH /v1/tenants/{tenant}/quota."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("tenant")
        kept = argparse.SUPPRESS
        parser.add_argument("--requests-per-second", type=float, default=kept)
        parser.add_argument("--tokens-per-minute", type=int, default=kept)
        parser.add_argument("--max-concurrent", dest="max_concurrent_requests", type=int, default=kept)
        parser.add_argument("--may-pin", action=argparse.BooleanOptionalAction, default=kept)
        parser.add_argument(
            "--may-deploy",
            action=argparse.BooleanOptionalAction,
            default=kept,
            help="roll out its own models, and the platform's granted it",
        )
        add_policy_flags(parser)

    def handle(self, *args: object, **options: object) -> None:
        name = str(options["tenant"])
        tenant = Tenant.objects.filter(name=name).first() if is_valid_name(name) else None
        if tenant is None:
            raise CommandError(f"unknown tenant {name!r}")
        settings = given_settings(options, SETTINGS)
        if not settings:
            raise CommandError("nothing to change: name a setting to change (see --help)")
        try:
            quota = quota_set(tenant=tenant, change=QuotaChange(**settings), actor=actors.command(__name__))
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        shown = ", ".join(f"{field}={getattr(quota, field)}" for field in SETTINGS)
        self.stdout.write(f"quota of {tenant.name}: {shown}")
