from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.management.quota_flags import (
    POLICY,
    add_limit_flags,
    add_model_flags,
    add_policy_flags,
    amend_tenant,
    given_settings,
    named_models,
)
from registry.services import AlreadyExists, RegistryError, tenant_create

LIMITS = ("requests_per_second", "tokens_per_minute", "max_concurrent_requests", "may_pin", "may_deploy")


class Command(BaseCommand):
    help = (
        "Create a tenant with its quota and rights; with --update, amend an existing one: only the flags "
        "named change (as set_quota does)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument(
            "--update",
            action="store_true",
            help="amend the existing tenant: the flags named change, the others stay (`none` empties a "
            "model list, an objective or a cap)",
        )
        add_limit_flags(parser)
        add_model_flags(parser)
        add_policy_flags(parser)

    def handle(self, *args: object, **options: object) -> None:
        name = str(options["name"])
        actor = actors.command(__name__)
        if options["update"]:
            self.stdout.write(amend_tenant(name, options, actor=actor))
            return
        try:
            tenant = tenant_create(
                name=name,
                **given_settings(options, (*LIMITS, *POLICY)),
                **named_models(options),
                actor=actor,
            )
        except AlreadyExists as exc:
            raise CommandError(f"{exc}: amend it with `create_tenant {name} --update …`") from None
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"created tenant {tenant.name}")
