from django.core.management.base import BaseCommand, CommandParser

from audit import actors
from registry.management.quota_flags import add_limit_flags, add_model_flags, add_policy_flags, amend_tenant


class Command(BaseCommand):
    help = (
        "Change a tenant's quota and rights: the settings named change, the others stay (`none` empties an "
        "objective, a cap or a model list). The same as `create_tenant NAME --update`, and as "
        "PATCH /v1/tenants/{tenant}/quota."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("tenant")
        add_limit_flags(parser)
        add_model_flags(parser)
        add_policy_flags(parser)

    def handle(self, *args: object, **options: object) -> None:
        self.stdout.write(amend_tenant(str(options["tenant"]), options, actor=actors.command(__name__)))
