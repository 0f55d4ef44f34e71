import shutil
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction
from django.utils import timezone

from registry.models import ApiKey, Model, Tenant
from registry.services import api_key_create, model_version_register, tenant_create

DEMO_MODEL = "demo-chat"
DEMO_EMBEDDING_MODEL = "demo-embed"
DEMO_CLASSIFIER_MODEL = "demo-classify"
DEMO_TENANT = "demo"
DEMO_KEY_NAME = "make-serve"


class Command(BaseCommand):
    help = (
        "Make sure the demo models (demo-chat v1, the embedding model demo-embed v1 and the classifier "
        "demo-classify v1, each stable, 100%) and the demo tenant exist, then issue a fresh demo API key "
        "(revoking the one issued last time) and print it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--no-key", action="store_true", help="do not issue a key")

    def handle(self, *args: object, **options: object) -> None:
        self._ensure_model(DEMO_MODEL, "demo-model", "build_demo_model", Model.Kind.CAUSAL_LM)
        self._ensure_model(
            DEMO_EMBEDDING_MODEL, "demo-embedding-model", "build_demo_embedding_model", Model.Kind.EMBEDDING
        )
        self._ensure_model(
            DEMO_CLASSIFIER_MODEL,
            "demo-classifier-model",
            "build_demo_classifier_model",
            Model.Kind.CLASSIFIER,
        )
        tenant = Tenant.objects.filter(name=DEMO_TENANT).first()
        if tenant is None:
            tenant = tenant_create(
                name=DEMO_TENANT,
                requests_per_second=50,
                tokens_per_minute=2_000_000,
                max_concurrent_requests=128,
                may_pin=True,
                may_deploy=True,
            )
            self.stdout.write(
                f"created tenant {DEMO_TENANT} (every model but other tenants' own; may pin; deploys its own)"
            )
        if options["no_key"]:
            return
        with transaction.atomic():
            ApiKey.objects.filter(tenant=tenant, name=DEMO_KEY_NAME, revoked_at__isnull=True).update(
                revoked_at=timezone.now()
            )
            _, raw_key = api_key_create(tenant=tenant, name=DEMO_KEY_NAME)
        self.stdout.write("demo API key (shown once; the previous demo key is now revoked):")
        self.stdout.write(raw_key)

    def _ensure_model(self, name: str, dir_name: str, builder: str, kind: str) -> None:
        """Register NAME v1, built with random weights under STATE_DIR by serving.engine.demo_model's
        `builder` the first time (imported only then: it imports torch)."""
        if Model.objects.filter(name=name).exists():
            return
        model_dir = Path(settings.STATE_DIR) / dir_name
        # Built aside and renamed into place: a build cut short (Ctrl-C during the first `make serve`)
        # left weights without a tokenizer, which every later run registered and no replica could load.
        # README.md is what every builder writes last, for a directory from before that.
        if not (model_dir / "README.md").exists():
            from serving.engine import demo_model

            self.stdout.write(f"building the random-weight {name} model in {model_dir}")
            building = model_dir.with_name(f".{dir_name}.building")
            shutil.rmtree(building, ignore_errors=True)
            getattr(demo_model, builder)(building)
            shutil.rmtree(model_dir, ignore_errors=True)
            building.rename(model_dir)
        mv = model_version_register(
            name=name, version="v1", source_dir=model_dir, kind=kind, created_by="seed_demo"
        )
        self.stdout.write(f"registered {name}:v1 sha256:{mv.sha256}")
