"""`manage.py bench engine|serve [options]`: the engine benchmark (serving/benchmarks/engine_bench.py) and
the serving benchmark through the HTTP API (serving/benchmarks/serve_bench.py)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = (
        "Benchmarks. `bench engine`: naive, static batching, transformers' continuous batching, the engine. "
        "`bench serve`: open-loop streaming load over HTTP; --compare runs the same workload through "
        "gateway + Channels + replica and through the engine alone."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        from serving.benchmarks.engine_bench import add_engine_arguments
        from serving.benchmarks.serve_bench import add_serve_arguments

        subcommands = parser.add_subparsers(dest="subcommand", required=True)
        engine = subcommands.add_parser(
            "engine", help="every system on one seeded workload and one model, in this process"
        )
        add_engine_arguments(engine)
        serve = subcommands.add_parser("serve", help="load through the HTTP API; --compare: vs. the engine")
        add_serve_arguments(serve)

    def handle(self, *args: object, **options: object) -> None:
        from serving.benchmarks.engine_bench import run_from_options
        from serving.benchmarks.serve_bench import run_serve_from_options

        runners = {"engine": run_from_options, "serve": run_serve_from_options}
        runner = runners.get(str(options["subcommand"]))
        if runner is None:
            raise CommandError(f"unknown benchmark {options['subcommand']!r}")
        try:
            text = runner(
                options,
                default_model_dir=Path(settings.STATE_DIR) / "bench-model",
                log=lambda line: self.stderr.write(line),
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(text)
