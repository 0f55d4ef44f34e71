from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.models import Tenant
from registry.services import RegistryError, api_key_revoke


class Command(BaseCommand):
    help = (
        "Revoke an API key: give the whole key, or its prefix as create_api_key printed it (sy-xxxxx; a "
        "prefix that several keys share needs --tenant). Gateways refuse it within a few seconds."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key", help="the key, or its first 8 characters")
        parser.add_argument("--tenant", help="with a prefix: revoke that tenant's keys that start so")

    def handle(self, *args: object, **options: str) -> None:
        tenant = None
        if options["tenant"]:
            tenant = Tenant.objects.filter(name=options["tenant"]).first()
            if tenant is None:
                raise CommandError(f"unknown tenant {options['tenant']!r}")
        try:
            revoked = api_key_revoke(
                key=options["key"].strip(), tenant=tenant, actor=actors.command(__name__)
            )
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        if not revoked:
            raise CommandError("no live key matches")
        for key in revoked:
            self.stdout.write(f"revoked {key.prefix}… of tenant {key.tenant.name}")
