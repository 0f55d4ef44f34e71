from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.models import Model
from registry.services import RegistryError, routing_table_set


class Command(BaseCommand):
    help = (
        "Set a model's traffic split, e.g. `set_traffic chat v1=90 v2=10` (whole percentages summing to 100)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("weights", nargs="+", metavar="VERSION=PCT")

    def handle(self, *args: object, **options: object) -> None:
        model = Model.objects.filter(name=str(options["model"])).first()
        if model is None:
            raise CommandError(f"unknown model {options['model']!r}")
        weights: dict[str, int] = {}
        for item in options["weights"]:  # type: ignore[attr-defined]
            version, _, pct = str(item).partition("=")
            if not version or not pct.isdigit():
                raise CommandError(f"expected VERSION=PCT, got {item!r}")
            weights[version] = int(pct)
        try:
            table = routing_table_set(model=model, weights=weights, actor=actors.command(__name__))
        except RegistryError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{model.name}: {weights} (revision {table.revision})")
