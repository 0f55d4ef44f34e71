import asyncio
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = (
        "Run one replica of a model version as its own process, on the Redis channel layer: load (digest "
        "checked), warm up, heartbeat, serve; SIGTERM drains (admits nothing new, finishes what it holds)."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: object) -> CommandParser:
        # Our --version names the model version; it replaces Django's own --version flag here.
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve", **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", required=True)
        parser.add_argument("--version", required=True)
        parser.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda when present)")
        parser.add_argument("--max-num-seqs", type=int, default=settings.REPLICA_MAX_NUM_SEQS)
        parser.add_argument(
            "--max-num-batched-tokens", type=int, default=settings.REPLICA_MAX_NUM_BATCHED_TOKENS
        )
        parser.add_argument(
            "--kv-cache-mb", type=int, default=settings.REPLICA_KV_CACHE_BYTES // (1024 * 1024)
        )
        parser.add_argument("--compile", action="store_true", default=settings.REPLICA_COMPILE)

    def handle(self, *args: object, **options: object) -> None:
        from registry.selectors import version_ref
        from serving.engine.engine import EngineConfig

        if not settings.REDIS_URL:
            raise CommandError("run_replica needs REDIS_URL; without it the server hosts its replicas itself")
        ref = version_ref(model_name=str(options["model"]), version=str(options["version"]))
        if ref is None:
            raise CommandError(f"unknown model version {options['model']}:{options['version']}")
        config = EngineConfig(
            max_num_seqs=int(options["max_num_seqs"]),  # type: ignore[call-overload]
            max_num_batched_tokens=int(options["max_num_batched_tokens"]),  # type: ignore[call-overload]
            kv_cache_bytes=int(options["kv_cache_mb"]) * 1024 * 1024,  # type: ignore[call-overload]
            compile=bool(options["compile"]),
            device=options["device"],  # type: ignore[arg-type]
        )
        code = asyncio.run(self._serve(ref, config))
        if code:
            raise CommandError(f"replica of {ref.model_name}:{ref.version} failed to start")

    async def _serve(self, ref: object, config: object) -> int:
        from channels.layers import get_channel_layer

        from serving.replica import Replica
        from serving.replica_directory import HeartbeatPublisher

        publisher = HeartbeatPublisher(settings.REDIS_URL)
        replica = Replica(ref, layer=get_channel_layer(), engine_config=config, publisher=publisher)  # type: ignore[arg-type]
        stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        await replica.start()
        if not replica.is_ready:
            self.stderr.write(f"load failed: {replica.error}")
            return 1
        self.stdout.write(
            f"replica {replica.replica_id} of {replica.ref.model_name}:{replica.ref.version} ready"
        )
        self.stdout.flush()
        await stop_requested.wait()
        replica.drain()  # the heartbeat now says draining: gateways stop choosing this replica
        self.stdout.write("draining")
        self.stdout.flush()
        await replica.wait_idle()
        await replica.stop()
        await publisher.close()
        return 0
