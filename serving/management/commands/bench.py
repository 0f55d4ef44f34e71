"""`manage.py bench engine|serve|embed|structured|lora|attention [options]`: the engine benchmark
(serving/benchmarks/engine_bench.py), the serving benchmark through the HTTP API
(serving/benchmarks/serve_bench.py), the embedding models' dynamic batcher against one input per forward
pass (serving/benchmarks/embed_bench.py), what structured outputs cost the engine
(serving/benchmarks/structured_bench.py), what LoRA adapters in the batch cost it
(serving/benchmarks/lora_bench.py) and how fast the paged-attention kernel reads the KV cache
(serving/benchmarks/attention_read.py)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = (
        "Benchmarks. `bench engine`: naive, static batching, transformers' continuous batching, the engine. "
        "`bench serve`: open-loop streaming load over HTTP; --compare runs the same workload through "
        "gateway + Channels + replica and through the engine alone. `bench embed`: the dynamic batcher "
        "against batch size 1 on an embedding model. `bench structured`: throughput with half the batch "
        "constrained to a JSON schema against none, and a schema's compile time. `bench lora`: 8 LoRA "
        "adapters mixed in the batch against the base alone, and an adapter's load on first use. "
        "`bench attention`: the paged-attention kernel's read of the KV cache against a streaming read."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        from serving.benchmarks.embed_bench import add_embed_arguments
        from serving.benchmarks.engine_bench import add_engine_arguments
        from serving.benchmarks.serve_bench import add_serve_arguments
        from serving.benchmarks.structured_bench import add_structured_arguments

        subcommands = parser.add_subparsers(dest="subcommand", required=True)
        engine = subcommands.add_parser(
            "engine", help="every system on one seeded workload and one model, in this process"
        )
        add_engine_arguments(engine)
        serve = subcommands.add_parser("serve", help="load through the HTTP API; --compare: vs. the engine")
        add_serve_arguments(serve)
        embed = subcommands.add_parser("embed", help="an embedding model: dynamic batching vs. batch size 1")
        add_embed_arguments(embed)
        structured = subcommands.add_parser(
            "structured", help="constrained decoding (response_format): its cost per step, compile time"
        )
        add_structured_arguments(structured)
        from serving.benchmarks.batching_sweep import add_batching_arguments

        batching = subcommands.add_parser(
            "batching", help="non-generative models: max batch size x max wait at three arrival rates"
        )
        add_batching_arguments(batching)
        from serving.benchmarks.lora_bench import add_lora_arguments

        lora = subcommands.add_parser("lora", help="LoRA adapters mixed in the batch vs. the base alone")
        add_lora_arguments(lora)
        from serving.benchmarks.attention_read import add_attention_arguments

        attention = subcommands.add_parser(
            "attention", help="the paged-attention kernel's KV read in a decode step vs. a streaming read"
        )
        add_attention_arguments(attention)

    def handle(self, *args: object, **options: object) -> None:
        from serving.benchmarks.attention_read import run_attention_from_options
        from serving.benchmarks.batching_sweep import run_batching_from_options
        from serving.benchmarks.embed_bench import run_embed_from_options
        from serving.benchmarks.engine_bench import run_from_options
        from serving.benchmarks.lora_bench import run_lora_from_options
        from serving.benchmarks.serve_bench import run_serve_from_options
        from serving.benchmarks.structured_bench import run_structured_from_options

        runners = {
            "engine": run_from_options,
            "serve": run_serve_from_options,
            "embed": run_embed_from_options,
            "structured": run_structured_from_options,
            "batching": run_batching_from_options,
            "lora": run_lora_from_options,
            "attention": run_attention_from_options,
        }
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
