import asyncio
import dataclasses
import math
import os
import signal
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from serving.transport.replica_directory import ROUTED_AFTER_LEAVING_S

DRAIN_REPORT_INTERVAL_S = 5.0


def engine_config_from_options(options: dict[str, object]) -> Any:
    """The replica's settings (SWITCHYARD_*), with this command's flags over them; what has no flag
    (SWITCHYARD_PACK_LINEAR) comes from the settings alone."""
    from serving.replica.config import engine_config_from_settings

    config = engine_config_from_settings()
    kv_cache_mb = options.get("kv_cache_mb")  # None: the settings' size, or sized from the device
    kv_cache_bytes = config.kv_cache_bytes if kv_cache_mb is None else int(kv_cache_mb) << 20  # type: ignore[call-overload]
    return dataclasses.replace(
        config,
        max_num_seqs=int(options["max_num_seqs"]),  # type: ignore[call-overload]
        max_num_batched_tokens=int(options["max_num_batched_tokens"]),  # type: ignore[call-overload]
        kv_cache_bytes=kv_cache_bytes,
        compile=bool(options["compile"]),
        device=options["device"],
    )


class Command(BaseCommand):
    _hung = False  # its replica's step hung (the watchdog): the process must exit without joining it

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
            "--kv-cache-mb",
            type=int,
            default=None,
            help="KV cache size (default: SWITCHYARD_KV_CACHE_MB, else SWITCHYARD_GPU_MEMORY_FRACTION of the "
            "GPU's free memory, 0.8, or 128 MiB on a CPU)",
        )
        parser.add_argument("--compile", action="store_true", default=settings.REPLICA_COMPILE)
        parser.add_argument(
            "--drain-timeout",
            type=float,
            default=settings.REPLICA_DRAIN_TIMEOUT_S,
            help="seconds a drain may take before the requests still held end with an error and the "
            "replica exits (default: SWITCHYARD_DRAIN_TIMEOUT_S, 570; 0: none)",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="serve this replica's /metrics text on this port, to SWITCHYARD_METRICS_TOKEN's bearer only",
        )
        parser.add_argument(
            "--metrics-addr", default="127.0.0.1", help="the address --metrics-port listens on (0.0.0.0: all)"
        )
        faults = parser.add_argument_group(
            "fault injection",
            "for demos and tests; refused unless DEBUG or SWITCHYARD_ALLOW_FAULT_INJECTION=1",
        )
        faults.add_argument("--inject-step-delay-ms", type=float, default=0.0, help="added to every step")
        faults.add_argument(
            "--inject-error-rate", type=float, default=0.0, help="fraction of requests failed at admission"
        )
        faults.add_argument("--inject-seed", type=int, default=0, help="seed of the error draws")

    def handle(self, *args: object, **options: object) -> None:
        from registry.selectors import version_ref
        from serving.replica.faults import FaultInjectionRefused, Faults, check_fault_injection_allowed

        try:
            faults = Faults(
                step_delay_ms=float(options["inject_step_delay_ms"]),  # type: ignore[arg-type]
                error_rate=float(options["inject_error_rate"]),  # type: ignore[arg-type]
                seed=int(options["inject_seed"]),  # type: ignore[call-overload]
            )
            if faults.is_active:
                check_fault_injection_allowed()
        except (FaultInjectionRefused, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        if not settings.REDIS_URL:
            raise CommandError("run_replica needs REDIS_URL; without it the server hosts its replicas itself")
        drain_timeout_s = float(options["drain_timeout"])  # type: ignore[arg-type]
        if not drain_timeout_s >= 0:  # NaN too
            raise CommandError("--drain-timeout must be 0 (none) or a number of seconds")
        if options["metrics_port"] is not None and not settings.METRICS_TOKEN:
            raise CommandError("--metrics-port needs SWITCHYARD_METRICS_TOKEN: scrapers authenticate with it")
        ref = version_ref(model_name=str(options["model"]), version=str(options["version"]))
        if ref is None:
            raise CommandError(f"unknown model version {options['model']}:{options['version']}")
        if ref.is_adapter:
            raise CommandError(
                f"{ref.model_name}:{ref.version} is a LoRA adapter: its base version's replicas serve it"
            )
        code = asyncio.run(
            self._serve(
                ref,
                engine_config_from_options(options),
                faults if faults.is_active else None,
                options["metrics_port"],
                str(options["metrics_addr"]),
                drain_timeout_s,
            )
        )
        if code and self._hung:
            # A hung step's thread cannot be stopped, and the interpreter would wait for it at exit
            # (it joins the executor's threads): the replica has stopped, so the process ends here.
            self.stderr.write(f"replica of {ref.model_name}:{ref.version} failed (see above)")
            self.stderr.flush()
            self.stdout.flush()
            os._exit(1)
        if code:
            raise CommandError(f"replica of {ref.model_name}:{ref.version} failed (see above)")

    async def _serve(
        self,
        ref: object,
        config: object,
        faults: object,
        metrics_port: object,
        metrics_addr: str,
        drain_timeout_s: float,
    ) -> int:
        from channels.layers import get_channel_layer

        from serving.replica.replica import Replica
        from serving.transport.replica_directory import HeartbeatPublisher
        from serving.transport.reply_hub import reply_layer

        if metrics_port is not None:
            from serving.telemetry.prometheus import start_metrics_server

            start_metrics_server(int(metrics_port), metrics_addr)  # type: ignore[call-overload]
        publisher = HeartbeatPublisher(settings.REDIS_URL)
        replica = Replica(
            ref,  # type: ignore[arg-type]
            layer=get_channel_layer(),
            replies=reply_layer(),
            engine_config=config,
            publisher=publisher,
            faults=faults,  # type: ignore[arg-type]
            torch_threads=settings.REPLICA_TORCH_THREADS,  # None: every core; the process is the replica's
        )
        stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        try:
            code = await self._run(replica, stop_requested, drain_timeout_s)
        finally:
            self._hung = replica.is_hung
            await replica.stop()  # withdraws its heartbeat, whatever it said last; waits out a load
            await replica.wait_loaded()  # start() ended too (stopped while it loaded)
            await publisher.close()
        if code == 0:
            self.stdout.write("stopped")
            self.stdout.flush()
        return code

    async def _run(self, replica: Any, stop_requested: asyncio.Event, drain_timeout_s: float = 0.0) -> int:
        """Load, serve until SIGTERM and drain, or end early: 1 if the load failed or the engine thread
        died. A drain still running after `drain_timeout_s` (0: none) ends what it holds with an error.
        The caller stops the replica either way."""
        starting = asyncio.ensure_future(replica.start())
        stopping = asyncio.ensure_future(stop_requested.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            # A stop while the model loads (a canary rolled back just after its replica was started): it
            # need not go ready only to drain. The load cannot be interrupted; the caller's replica.stop()
            # waits it out, and start() then serves nothing.
            self.stdout.write("stop requested while loading: stopping without serving")
            self.stdout.flush()
            return 0
        if not replica.is_ready:
            self.stderr.write(f"load failed: {replica.error}")
            return 1
        self.stdout.write(
            f"replica {replica.replica_id} of {replica.ref.model_name}:{replica.ref.version} ready"
        )
        self.stdout.flush()
        failed = asyncio.ensure_future(replica.wait_failed())
        await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            # The engine thread died, or a step hung (the watchdog): the replica would beat "failed" for
            # ever, and a supervisor restarts only a process that has exited (the provisioner; Kubernetes
            # without a liveness probe).
            stopping.cancel()
            self.stderr.write(f"{replica.error or 'the engine thread ended'}; exiting")
            return 1
        failed.cancel()
        await replica.announce_drain()  # the heartbeat now says draining: gateways stop choosing it
        self.stdout.write("draining")
        self.stdout.flush()
        # Requests sent by gateways that had not yet seen it are served, not refused and retried; with
        # two replicas leaving at once, a retry could land on the other and fail.
        await asyncio.sleep(ROUTED_AFTER_LEAVING_S)
        replica.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s if drain_timeout_s > 0 else math.inf
        while True:  # a drain that takes long says, now and then, what it still holds
            try:
                await asyncio.wait_for(
                    replica.wait_idle(), max(0.0, min(DRAIN_REPORT_INTERVAL_S, deadline - loop.time()))
                )
                break
            except TimeoutError:
                beat = replica.heartbeat()
                held = f"{beat.num_running} running, {beat.num_waiting} waiting"
                if loop.time() < deadline:
                    self.stdout.write(f"draining: {held}")
                else:
                    self.stderr.write(f"drain deadline ({drain_timeout_s:g} s) passed: ending {held}")
                    replica.end_drain(f"the replica stopped: its drain ran past {drain_timeout_s:g} s")
                    deadline = math.inf  # they end at the model thread's next pass; idle follows
                self.stdout.flush()
        self.stdout.write("drained; stopping")
        self.stdout.flush()
        return 0
