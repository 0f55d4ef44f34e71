from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from registry.artifacts import ArtifactError
from registry.models import Model
from registry.services import RegistryError, model_version_register


class Command(BaseCommand):
    help = "Copy a Hugging Face model directory (safetensors only) into the artifact store as NAME:VERSION."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("version")
        parser.add_argument("--from", dest="source", required=True, help="the model directory")
        parser.add_argument("--kind", choices=[k.value for k in Model.Kind], default=Model.Kind.CAUSAL_LM)
        parser.add_argument("--created-by", default="cli")

    def handle(self, *args: object, **options: str) -> None:
        try:
            mv = model_version_register(
                name=options["name"],
                version=options["version"],
                source_dir=Path(options["source"]),
                kind=options["kind"],
                created_by=options["created_by"],
            )
        except (ArtifactError, RegistryError) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"registered {mv.model.name}:{mv.version} ({mv.size_bytes} bytes)")
        self.stdout.write(f"sha256:{mv.sha256}")
