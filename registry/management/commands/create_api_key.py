from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.models import Tenant
from registry.services import api_key_create


class Command(BaseCommand):
    help = (
        "Create an API key for a tenant. The key is printed once, alone on the last line; "
        "only its hash is kept."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", required=True)
        parser.add_argument("--name", default="")

    def handle(self, *args: object, **options: str) -> None:
        tenant = Tenant.objects.filter(name=options["tenant"]).first()
        if tenant is None:
            raise CommandError(f"unknown tenant {options['tenant']!r}")
        api_key, raw_key = api_key_create(tenant=tenant, name=options["name"], actor=actors.command(__name__))
        self.stderr.write(
            f"created key {api_key.prefix}… for tenant {tenant.name}; it will not be shown again"
        )
        self.stdout.write(raw_key)
