from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.management.quota_flags import add_policy_flags, given_settings
from registry.models import Model
from registry.services import RegistryError, tenant_create


class Command(BaseCommand):
    help = "Create a tenant with its quota."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--requests-per-second", type=float, default=10.0)
        parser.add_argument("--tokens-per-minute", type=int, default=100_000)
        parser.add_argument("--max-concurrent", type=int, default=16)
        parser.add_argument(
            "--allow-model",
            action="append",
            default=[],
            help="repeat; none: every model but other tenants' own (a named one may be another's: shared)",
        )
        parser.add_argument("--may-pin", action="store_true")
        parser.add_argument("--may-deploy", action="store_true", help="roll out its own models (Model.owner)")
        parser.add_argument(
            "--deploy-model",
            action="append",
            default=[],
            help="repeat; a platform model it may roll out too (with --may-deploy): its traffic is every "
            "tenant's it serves",
        )
        add_policy_flags(parser)

    def handle(self, *args: object, **options: object) -> None:
        names = list(options["allow_model"])  # type: ignore[call-overload]
        deploy_names = list(options["deploy_model"])  # type: ignore[call-overload]
        models = list(Model.objects.filter(name__in=names))
        deployable = list(Model.objects.filter(name__in=deploy_names))
        missing = sorted({*names, *deploy_names} - {m.name for m in (*models, *deployable)})
        if missing:
            raise CommandError(f"unknown model(s): {', '.join(missing)}")
        try:
            tenant = tenant_create(
                name=str(options["name"]),
                requests_per_second=float(options["requests_per_second"]),  # type: ignore[arg-type]
                tokens_per_minute=int(options["tokens_per_minute"]),  # type: ignore[call-overload]
                max_concurrent_requests=int(options["max_concurrent"]),  # type: ignore[call-overload]
                allowed_models=models,
                may_pin=bool(options["may_pin"]),
                may_deploy=bool(options["may_deploy"]),
                deployable_models=deployable,
                **given_settings(options),
                actor=actors.command(__name__),
            )
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"created tenant {tenant.name}")
