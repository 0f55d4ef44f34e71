from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from audit import actors
from registry.artifacts import ArtifactError
from registry.models import Model, ModelVersion, Tenant
from registry.services import RegistryError, model_version_register


class Command(BaseCommand):
    help = "Copy a Hugging Face model directory (safetensors only) into the artifact store as NAME:VERSION."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("version")
        parser.add_argument("--from", dest="source", required=True, help="the model directory")
        parser.add_argument("--kind", choices=[k.value for k in Model.Kind], default=Model.Kind.CAUSAL_LM)
        parser.add_argument("--created-by", default="cli")
        parser.add_argument(
            "--owner",
            metavar="TENANT",
            help="a new model's owning tenant: the one that sees, uses and deploys it unless a quota names "
            "it (default: none, the platform's: staff deploy it, and tenants granted it)",
        )
        parser.add_argument(
            "--parent", metavar="VERSION", help="the version of the same model this one was made from"
        )
        parser.add_argument(
            "--adapter-of",
            metavar="BASE:VERSION",
            help="a PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) applying to this "
            "base version, whose replicas serve it",
        )

    def handle(self, *args: object, **options: str) -> None:
        owner = parent = adapter_of = None
        if options["owner"]:
            owner = Tenant.objects.filter(name=options["owner"]).first()
            if owner is None:
                raise CommandError(f"no tenant {options['owner']!r}")
        if options["parent"]:
            parent = ModelVersion.objects.filter(
                model__name=options["name"], version=options["parent"]
            ).first()
            if parent is None:
                raise CommandError(f"no version {options['name']}:{options['parent']} to be the parent")
        if options["adapter_of"]:
            base_name, _, base_version = options["adapter_of"].partition(":")
            adapter_of = (
                ModelVersion.objects.filter(model__name=base_name, version=base_version)
                .select_related("model")
                .first()
            )
            if adapter_of is None:
                raise CommandError(f"no base version {options['adapter_of']!r} (give it as BASE:VERSION)")
        try:
            mv = model_version_register(
                name=options["name"],
                version=options["version"],
                source_dir=Path(options["source"]),
                kind=options["kind"],
                created_by=options["created_by"],
                parent=parent,
                owner=owner,
                actor=actors.command(__name__),
                adapter_of=adapter_of,
            )
        except (ArtifactError, RegistryError) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"registered {mv.model.name}:{mv.version} ({mv.size_bytes} bytes)")
        self.stdout.write(f"sha256:{mv.sha256}")
