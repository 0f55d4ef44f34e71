from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = (
        "Write a small Llama-style model with seeded random weights and a locally built tokenizer to DIR; "
        "with --adapter-of MODEL_DIR, a random LoRA adapter of that model instead, as PEFT saves one."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("dir")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--adapter-of", metavar="MODEL_DIR", help="a local model directory (config.json)")
        parser.add_argument("--rank", type=int, default=8, help="the adapter's rank (with --adapter-of)")

    def handle(self, *args: object, **options: object) -> None:
        # Deferred: they import torch, which `manage.py help` and every other command need not load.
        from serving.engine.demo_adapter import write_random_adapter
        from serving.engine.demo_model import DemoModelSpec, build_demo_model

        out = Path(str(options["dir"]))
        if out.exists() and any(out.iterdir()):
            raise CommandError(f"{out} exists and is not empty")
        if options["adapter_of"]:
            base = Path(str(options["adapter_of"]))
            if not (base / "config.json").is_file():
                raise CommandError(f"{base} holds no config.json: --adapter-of names a model directory")
            write_random_adapter(base, out, rank=int(options["rank"]), seed=int(options["seed"]))
            self.stdout.write(f"wrote a random rank-{options['rank']} LoRA adapter of {base} to {out}")
            return
        build_demo_model(out, DemoModelSpec(seed=int(options["seed"])))  # type: ignore[call-overload]
        self.stdout.write(f"wrote a random-weight demo model to {out}")
