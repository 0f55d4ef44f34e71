from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import IntegrityError

from registry.models import Model
from rollouts.models import ScalingBounds


class Command(BaseCommand):
    help = (
        "Set a model's own replica bounds for the autoscaler, e.g. `set_scaling chat --min 2 --max 8`; "
        "`--clear` goes back to the defaults (SWITCHYARD_AUTOSCALER_MIN_REPLICAS/MAX_REPLICAS). Every "
        "serving version of the model gets between min and max replicas from the next tick on."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("--min", type=int, dest="min_replicas")
        parser.add_argument("--max", type=int, dest="max_replicas")
        parser.add_argument("--clear", action="store_true")

    def handle(self, *args: object, **options: object) -> None:
        from django.conf import settings

        model = Model.objects.filter(name=str(options["model"])).first()
        if model is None:
            raise CommandError(f"unknown model {options['model']!r}")
        if options["clear"]:
            ScalingBounds.objects.filter(model=model).delete()
            self.stdout.write(f"{model.name}: the autoscaler's defaults")
            return
        current = ScalingBounds.objects.filter(model=model).first()
        defaults = (
            (current.min_replicas, current.max_replicas)
            if current is not None
            else (settings.AUTOSCALER["min_replicas"], settings.AUTOSCALER["max_replicas"])
        )
        low = options["min_replicas"] if options["min_replicas"] is not None else defaults[0]
        high = options["max_replicas"] if options["max_replicas"] is not None else defaults[1]
        if not 1 <= int(low) <= int(high):  # type: ignore[call-overload]
            raise CommandError(f"need 1 <= min <= max (no scaling to zero), got min {low}, max {high}")
        try:
            ScalingBounds.objects.update_or_create(
                model=model, defaults={"min_replicas": low, "max_replicas": high}
            )
        except IntegrityError as exc:  # the database's own check, should the one above ever differ
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{model.name}: {low} to {high} replicas per serving version")
