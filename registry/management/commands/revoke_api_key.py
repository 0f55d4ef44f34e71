from django.core.management.base import BaseCommand, CommandError, CommandParser

from registry.services import RegistryError, api_key_revoke


class Command(BaseCommand):
    help = (
        "Revoke an API key: give the whole key, or its prefix as create_api_key printed it (sy-xxxxx). "
        "Gateways refuse it within a few seconds (their auth cache)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key", help="the key, or its first 8 characters")

    def handle(self, *args: object, **options: str) -> None:
        try:
            revoked = api_key_revoke(prefix=options["key"].strip())
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        if not revoked:
            raise CommandError("no live key matches")
        for key in revoked:
            self.stdout.write(f"revoked {key.prefix}… of tenant {key.tenant.name}")
