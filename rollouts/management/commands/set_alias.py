from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.models import Alias, Model
from registry.services import RegistryError, alias_set
from rollouts.selectors import deployment_in_flight
from rollouts.services import CANARY_ALIAS


class Command(BaseCommand):
    help = (
        "Point a model's alias at a version, e.g. `set_alias chat stable v1` to send `chat@stable` back to "
        "v1. The move is logged (AliasEvent) and every gateway follows it within a second, as a routing "
        "edit. The canary alias is the rollouts' own while a deployment is in flight."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("alias")
        parser.add_argument("version")
        parser.add_argument("--reason", default="set by hand (manage.py set_alias)")

    def handle(self, *args: object, **options: str) -> None:
        model = Model.objects.filter(name=options["model"]).first()
        if model is None:
            raise CommandError(f"unknown model {options['model']!r}")
        version = model.versions.filter(version=options["version"]).first()
        if version is None:
            raise CommandError(f"unknown version {options['version']!r} of {model.name}")
        try:
            Alias._meta.get_field("name").run_validators(options["alias"])
        except ValidationError as exc:
            raise CommandError(f"invalid alias name: {' '.join(exc.messages)}") from None
        if options["alias"] == CANARY_ALIAS and deployment_in_flight(model=model) is not None:
            raise CommandError(f"{model.name} has a deployment in flight: its canary alias is the rollout's")
        try:
            alias_set(
                model=model,
                name=options["alias"],
                version=version,
                actor=actors.command(__name__),
                reason=options["reason"],
            )
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{model.name}@{options['alias']} -> {version.version}")
