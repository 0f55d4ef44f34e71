import secrets
import shutil
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import IntegrityError, transaction

from audit import actors
from registry.models import ApiKey, Model, Tenant
from registry.quotas import QuotaChange
from registry.services import (
    api_key_create,
    api_keys_revoke,
    model_version_register,
    quota_set,
    tenant_create,
)
from rollouts.scaling import scaling_bounds_set

DEMO_MODEL = "demo-chat"
DEMO_EMBEDDING_MODEL = "demo-embed"
DEMO_CLASSIFIER_MODEL = "demo-classify"
# The demo tenant's own model (Model.owner), which it rolls out as README.md's "A first rollout" shows:
# demo-chat's weights, scaled to zero so that `make serve` runs no replica for it until it is used.
DEMO_OWN_MODEL = "demo-finetune"
DEMO_TENANT = "demo"
DEMO_KEY_NAME = "make-serve"
ACTOR = actors.command(__name__)  # how the audit log names this command's changes
STAFF_LOGIN = "admin"  # the dashboard's (and the admin's) first login


class Command(BaseCommand):
    help = (
        "Make sure the demo models (demo-chat v1, the embedding model demo-embed v1 and the classifier "
        "demo-classify v1, each stable, 100%), the demo tenant, its own model demo-finetune v1 (demo-chat's "
        "weights, scaled to zero: a replica only while it is used) and a staff login for the dashboard "
        "exist (the login's password is printed once, when it is made), then issue a fresh demo API key "
        "(revoking the one issued last time) and print it on the last line."
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
        # The demo tenant rolls out its own model (README.md's "A first rollout"), and demo-chat too (the
        # platform's, granted it): a tenant deploys only its own models and those granted it.
        demo_chat = Model.objects.get(name=DEMO_MODEL)
        tenant = Tenant.objects.filter(name=DEMO_TENANT).first()
        if tenant is None:
            tenant = tenant_create(
                name=DEMO_TENANT,
                requests_per_second=50,
                tokens_per_minute=2_000_000,
                max_concurrent_requests=128,
                may_pin=True,
                may_deploy=True,
                deployable_models=[demo_chat],
                actor=ACTOR,
            )
            self.stdout.write(
                f"created tenant {DEMO_TENANT} (every model but other tenants' own; may pin; deploys its own "
                f"and {DEMO_MODEL})"
            )
        elif tenant.quota.may_deploy and not tenant.quota.deployable_models.exists():
            # A demo tenant made before it was granted demo-chat: granted it now, as a new one is.
            quota_set(tenant=tenant, change=QuotaChange(deployable_models=(demo_chat,)), actor=ACTOR)
        self._ensure_own_model(tenant, demo_chat)
        self._ensure_staff_login()
        if options["no_key"]:
            return
        with transaction.atomic():
            api_keys_revoke(
                api_keys=ApiKey.objects.filter(tenant=tenant, name=DEMO_KEY_NAME, revoked_at__isnull=True),
                actor=ACTOR,
            )
            _, raw_key = api_key_create(tenant=tenant, name=DEMO_KEY_NAME, actor=ACTOR)
        self.stdout.write("demo API key (shown once; the previous demo key is now revoked):")
        self.stdout.write(raw_key)

    def _ensure_staff_login(self) -> None:
        """A superuser to sign in to /dashboard/ and /admin/ with. Its random password is printed when it
        is made and never again: Django keeps only its hash, so a later run can only say how to set a
        new one. An existing user of that name is left as it is, whatever it is."""
        users = get_user_model()
        reset = f".venv/bin/python manage.py changepassword {STAFF_LOGIN}"
        existing = users.objects.filter(**{users.USERNAME_FIELD: STAFF_LOGIN}).first()
        if existing is None:
            password = secrets.token_urlsafe(12)
            try:
                with transaction.atomic():
                    users.objects.create_superuser(STAFF_LOGIN, "", password)
            except IntegrityError:  # another seed_demo made it meanwhile, and printed its password
                existing = users.objects.get(**{users.USERNAME_FIELD: STAFF_LOGIN})
            else:
                self.stdout.write(
                    "dashboard staff login (shown once; sign in at /dashboard/, "
                    f"set a new password with `{reset}`):"
                )
                self.stdout.write(f"  username: {STAFF_LOGIN}")
                self.stdout.write(f"  password: {password}")
                return
        if existing.is_active and existing.is_staff:
            self.stdout.write(
                f"dashboard staff login: {STAFF_LOGIN} exists (its password was shown when it was made; "
                f"set a new one with `{reset}`)"
            )
        else:
            self.stdout.write(
                f"a user {STAFF_LOGIN} exists but is not active staff, so it cannot sign in to the "
                "dashboard; make a login that can with `.venv/bin/python manage.py createsuperuser`"
            )

    def _ensure_own_model(self, tenant: Tenant, demo_chat: Model) -> None:
        """The demo tenant's own model, v1 a copy of demo-chat's first version (whatever it was registered
        from), scaled to zero (docs/architecture.md, "Replicas kept warm"): a fourth model must not hold
        a fourth replica from the start (serving/replica/on_demand.py); a rollout keeps its candidate's."""
        if Model.objects.filter(name=DEMO_OWN_MODEL).exists():
            return
        source = demo_chat.versions.order_by("created_at", "pk").first()
        if source is None:
            return
        mv = model_version_register(
            name=DEMO_OWN_MODEL,
            version="v1",
            source_dir=Path(source.artifact_uri),
            owner=tenant,
            created_by="seed_demo",
            actor=ACTOR,
        )
        scaling_bounds_set(model=mv.model, min_replicas=0, max_replicas=1, actor=ACTOR)
        self.stdout.write(
            f"registered {DEMO_OWN_MODEL}:v1 sha256:{mv.sha256} ({DEMO_TENANT}'s own; no replica until used)"
        )

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
            name=name, version="v1", source_dir=model_dir, kind=kind, created_by="seed_demo", actor=ACTOR
        )
        self.stdout.write(f"registered {name}:v1 sha256:{mv.sha256}")
