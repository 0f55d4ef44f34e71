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


def _local(options: dict[str, Any]) -> Any:
    from rollouts.fleet.provisioner import LocalProvisioner, run_replica_launcher

    if options["image"] or options["namespace"]:
        raise CommandError("--image and --namespace are for --kubernetes")

    return LocalProvisioner(
        run_replica_launcher(Path(settings.BASE_DIR) / "manage.py"),
        devices=_devices(options["devices"]),
        models=frozenset(options["models"]) if options["models"] else None,
        restart_delay_s=options["restart_delay"],
    )


def _kubernetes(options: dict[str, Any]) -> Any:
    from rollouts.fleet.kubernetes import DeploymentsApi, KubernetesProvisioner, PodTemplate

    if not options["image"]:
        raise CommandError("--kubernetes needs --image")
    if options["devices"] != "auto":
        raise CommandError("--devices is for local processes; on Kubernetes each pod gets its own GPU")
    try:
        api = DeploymentsApi.in_cluster(options["namespace"])
    except (KeyError, OSError) as exc:
        raise CommandError(f"not in a Kubernetes pod with a service account: {exc}") from None
    template = PodTemplate(
        image=options["image"],
        artifact_claim=options["artifact_claim"],
        artifact_root=str(settings.ARTIFACT_ROOT),
        env_from=(options["env_secret"],),
        gpus=options["gpus_per_replica"],
    )
    models = frozenset(options["models"]) if options["models"] else None
    return KubernetesProvisioner(api, template, models=models)


def _describe(provisioner: Any) -> str:
    devices = getattr(provisioner, "devices", None)
    return f"local processes on {', '.join(devices)}" if devices else "a Kubernetes Deployment per version"


class Command(BaseCommand):
    help = (
        "Keep every model version at the autoscaler's target of replicas (a version that must serve and has "
        "no target yet: one): as run_replica processes on this machine, drained by SIGTERM or Ctrl-C here "
        "before it exits; or with --kubernetes as a Deployment per version, which go on running when it "
        "stops. Needs Redis (replicas serve over it)."
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
        cluster = parser.add_argument_group(
            "Kubernetes", "a Deployment per version instead of local processes (in-cluster service account)"
        )
        cluster.add_argument("--kubernetes", action="store_true")
        cluster.add_argument("--image", help="the image replicas run (this project's)")
        cluster.add_argument("--namespace", default=None, help="default: the service account's")
        cluster.add_argument("--gpus-per-replica", type=int, default=1, choices=(0, 1))
        cluster.add_argument(
            "--artifact-claim",
            default="switchyard-artifacts",
            help="the ReadWriteMany claim holding ARTIFACT_ROOT, mounted there in every replica pod",
        )
        cluster.add_argument(
            "--env-secret", default="switchyard-env", help="the Secret replicas take their environment from"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from rollouts.selectors import wanted_replicas

        if not settings.REDIS_URL:
            raise CommandError("replica processes serve over Redis: set REDIS_URL")
        if options["interval"] <= 0:
            raise CommandError("--interval must be above 0")
        provisioner = _kubernetes(options) if options["kubernetes"] else _local(options)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        self.stdout.write(f"provisioner: {_describe(provisioner)}; every {options['interval']:g} s")
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
            self.stdout.write("provisioner: stopping")
            provisioner.shutdown()  # local: drains every replica; Kubernetes: they run on
