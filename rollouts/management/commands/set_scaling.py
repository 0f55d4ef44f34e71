from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.models import Model
from rollouts.scaling import scaling_bounds_clear, scaling_bounds_set


class Command(BaseCommand):
    help = (
        "Set a model's own replica bounds for the autoscaler, e.g. `set_scaling chat --min 2 --max 8`; "
        "`--min 0` scales its idle versions to zero (a request then waits while a replica starts); "
        "`--clear` goes back to the defaults (SWITCHYARD_AUTOSCALER_MIN_REPLICAS/MAX_REPLICAS). Every "
        "serving version of the model gets between min and max replicas from the next tick on."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("model")
        parser.add_argument("--min", type=int, dest="min_replicas")
        parser.add_argument("--max", type=int, dest="max_replicas")
        parser.add_argument("--clear", action="store_true")

    def handle(self, *args: object, **options: object) -> None:
        model = Model.objects.filter(name=str(options["model"])).first()
        if model is None:
            raise CommandError(f"unknown model {options['model']!r}")
        if options["clear"]:
            scaling_bounds_clear(model=model, actor=actors.command(__name__))
            self.stdout.write(f"{model.name}: the autoscaler's defaults")
            return
        try:
            bounds = scaling_bounds_set(
                model=model,
                min_replicas=options["min_replicas"],  # type: ignore[arg-type]
                max_replicas=options["max_replicas"],  # type: ignore[arg-type]
                actor=actors.command(__name__),
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"{model.name}: {bounds.min_replicas} to {bounds.max_replicas} replicas per serving version"
        )
        if bounds.min_replicas == 0:
            # The embedded supervisor retires its on-demand replicas by its own keep-warm time
            # (serving/replica/on_demand.py); the autoscaler, by its idle time.
            idle = (
                settings.REPLICA_KEEP_WARM_S
                if settings.EMBEDDED_REPLICAS
                else settings.AUTOSCALER["idle_before_zero_s"]
            )
            self.stdout.write(f"{model.name}: a version with no request for {idle:g} s scales to zero")
