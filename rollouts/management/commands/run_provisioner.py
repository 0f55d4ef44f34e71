import signal
import threading
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections


def _devices(spec: str) -> list[str]:
    if spec != "auto":
        devices = [d.strip() for d in spec.split(",") if d.strip()]
        if not devices or not all(d == "cpu" or d.startswith("cuda:") for d in devices):
            raise CommandError("--devices takes auto, cpu or a list such as cuda:0,cuda:1")
        return devices
    import torch

    count = torch.cuda.device_count()
    return [f"cuda:{i}" for i in range(count)] if count else ["cpu"]


class Command(BaseCommand):
    help = (
        "Run this machine's replicas: start and stop `run_replica` processes so that every model version "
        "has as many as the autoscaler's target (a version that must serve and has no target yet: one). "
        "Needs Redis (replica processes serve over it). SIGTERM or Ctrl-C drains every replica and exits."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--devices",
            default="auto",
            help="cpu, or the GPUs replicas may use, one each (cuda:0,cuda:1); auto: every GPU, else cpu",
        )
        parser.add_argument(
            "--model", action="append", dest="models", help="serve only this model (repeatable)"
        )
        parser.add_argument("--interval", type=float, default=2.0, help="seconds between passes")
        parser.add_argument("--restart-delay", type=float, default=5.0, help="least seconds before a restart")

    def handle(self, *args: Any, **options: Any) -> None:
        from rollouts.provisioner import LocalProvisioner, run_replica_launcher
        from rollouts.selectors import wanted_replicas

        if not settings.REDIS_URL:
            raise CommandError("replica processes serve over Redis: set REDIS_URL")
        provisioner = LocalProvisioner(
            run_replica_launcher(Path(settings.BASE_DIR) / "manage.py"),
            devices=_devices(options["devices"]),
            models=frozenset(options["models"]) if options["models"] else None,
            restart_delay_s=options["restart_delay"],
        )
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.stdout.write(
            f"provisioner: devices {', '.join(provisioner.devices)}; every {options['interval']:g} s"
        )
        try:
            while not stop.is_set():
                try:
                    provisioner.reconcile(wanted_replicas())
                except Exception as exc:  # a database that is down: keep what runs, try again
                    self.stderr.write(f"provisioner: pass failed, keeping the replicas as they are: {exc}")
                finally:
                    close_old_connections()
                stop.wait(options["interval"])
        finally:
            self.stdout.write("provisioner: draining every replica")
            provisioner.shutdown()
