from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = "Write a small Llama-style model with seeded random weights and a locally built tokenizer to DIR."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("dir")
        parser.add_argument("--seed", type=int, default=0)

    def handle(self, *args: object, **options: object) -> None:
        # Deferred: it imports torch, which `manage.py help` and every other command need not load.
        from serving.engine.demo_model import DemoModelSpec, build_demo_model

        out = Path(str(options["dir"]))
        if out.exists() and any(out.iterdir()):
            raise CommandError(f"{out} exists and is not empty")
        build_demo_model(out, DemoModelSpec(seed=int(options["seed"])))  # type: ignore[call-overload]
        self.stdout.write(f"wrote a random-weight demo model to {out}")
