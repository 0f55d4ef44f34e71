"""Settings read from the environment. The embedded default needs none of them:
SQLite under var/, the in-memory channel layer, replicas inside the server process."""

import contextlib
import math
import os
from pathlib import Path

import dj_database_url

# Weights never come from a hub at run time, and progress bars do not belong in server logs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("SWITCHYARD_STATE_DIR", BASE_DIR / "var"))


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


DEBUG = _env_bool("DEBUG", False)

# Production brings SECRET_KEY in the environment, and with it the HTTPS-only defaults below. The
# embedded default (no SECRET_KEY) keeps a random key in the state directory and serves plain HTTP
# on localhost.
IS_PRODUCTION = bool(os.environ.get("SECRET_KEY"))
SECRET_KEY = os.environ.get("SECRET_KEY") or ""
if not SECRET_KEY:
    _key_file = STATE_DIR / "secret_key"
    if not _key_file.exists():
        import secrets

        STATE_DIR.mkdir(parents=True, exist_ok=True)
        # Written whole, readable by its owner only from the start, under a name of its own, then linked
        # into place: no moment where another user may read it, nor another process read it half written.
        _new_key = STATE_DIR / f".secret_key.{os.getpid()}"
        _new_key.unlink(missing_ok=True)  # left by a process of the same pid that died here
        _fd = os.open(_new_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(_fd, "w") as _out:
            _out.write(secrets.token_urlsafe(50))
        try:
            os.link(_new_key, _key_file)
        except FileExistsError:  # another process made it first: its key is the one
            pass
        except OSError:  # a filesystem without hard links: renamed, still whole and 0600
            os.replace(_new_key, _key_file)
        finally:
            _new_key.unlink(missing_ok=True)
    if _key_file.stat().st_mode & 0o077:  # one made loose by hand, or by an older version
        # Not ours to change (a read-only image, another owner): serve with it as it is.
        with contextlib.suppress(OSError):
            _key_file.chmod(0o600)
    SECRET_KEY = _key_file.read_text().strip()

ALLOWED_HOSTS = [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "audit",  # below every app: they all record their changes in it
    "registry",
    "serving",
    "rollouts",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "registry.login_throttle.LoginThrottleMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# libpq's: give up a connect after 5 s; drop a connection whose sent data goes unacknowledged for 10 s,
# or whose peer stops answering keepalives (10 s idle, then 3 probes 2 s apart) while a reply is awaited.
POSTGRES_CONNECTION_TIMEOUTS = {
    "connect_timeout": 5,
    "tcp_user_timeout": 10_000,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}
if not os.environ.get("DATABASE_URL"):
    # The embedded database's folder: with SECRET_KEY set, nothing above has made it (sqlite cannot).
    STATE_DIR.mkdir(parents=True, exist_ok=True)
DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{STATE_DIR / 'switchyard.sqlite3'}",
        conn_max_age=60,
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several threads (the server's and the replicas') write. IMMEDIATE takes the write lock when a
    # transaction begins, so one that read first cannot fail with "database is locked" when it writes;
    # the timeout makes the others wait for it instead of failing.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
    DATABASES["default"]["CONN_MAX_AGE"] = 0
else:
    # Kept connections are checked before their first query after each request or worker-thread call,
    # so one the server dropped (restart, failover) is replaced instead of failing that query.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    # A database that hangs rather than refusing (a partition drops packets) must fail a call in seconds,
    # not after the kernel's TCP retries (~15 min), so that the gateway's fallbacks (the last good routing
    # table, keys checked recently) take over. What DATABASE_URL's query string sets wins.
    for _name, _value in POSTGRES_CONNECTION_TIMEOUTS.items():
        DATABASES["default"].setdefault("OPTIONS", {}).setdefault(_name, _value)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL") or None
# The HMAC key of the submission layer's messages, which every gateway and replica of a deployment share:
# by default the SECRET_KEY they share already (docs/reliability.md, "The wire").
WIRE_SECRET = os.environ.get("SWITCHYARD_WIRE_SECRET") or SECRET_KEY
if REDIS_URL:
    # redis-py 8 times out an idle blocking read after 5 s unless told otherwise.
    _REDIS_HOSTS = [{"address": REDIS_URL, "socket_timeout": None}]
    CHANNEL_LAYERS = {
        # Submissions and aborts: queued, so a replica busy for a moment still gets them.
        "default": {
            "BACKEND": "serving.transport.channel_layers.OneTripRedisChannelLayer",
            # Each message carries an HMAC from the shared secret; a replica drops one that does not match
            # (serving/transport/wire_signing.py).
            "CONFIG": {"hosts": _REDIS_HOSTS, "serializer_format": "json", "signing_key": WIRE_SECRET},
        },
        # The token stream, replica -> gateway inbox: one PUBLISH per engine step and inbox, delivered
        # on a connection the gateway already holds (~0.2 ms round trip against ~0.9 ms on the core
        # layer). A gateway subscribes to its inbox before it submits anything; a replica's model thread
        # publishes its steps itself (serving/transport/channel_layers.py says why).
        "replies": {
            "BACKEND": "serving.transport.channel_layers.StepPubSubChannelLayer",
            "CONFIG": {"hosts": _REDIS_HOSTS, "serializer_format": "json"},
        },
    }
else:
    # Embedded: one in-memory layer carries both (the "replies" alias falls back to "default").
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# The one schedule: `celery -A config beat` reads it (config/celery.py loads the CELERY_ settings), and the
# embedded scheduler (config.periodic) runs the same entries inside the server process when there is no
# Redis; tests/e2e/test_celery_live.py fails if the two ever read different ones. The two ticks' periods
# come from the environment (docs/configuration.md, "Background ticks").
ROLLOUT_JUDGE_INTERVAL_S = float(os.environ.get("SWITCHYARD_ROLLOUT_JUDGE_INTERVAL_S", "5"))
AUTOSCALER_INTERVAL_S = float(os.environ.get("SWITCHYARD_AUTOSCALER_INTERVAL_S", "5"))
CELERY_BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "rollout-judge": {
        "task": "rollouts.tasks.rollout_judge_tick",
        "schedule": ROLLOUT_JUDGE_INTERVAL_S,
        "options": {"expires": ROLLOUT_JUDGE_INTERVAL_S},  # a tick not run in time is dropped, not queued
    },
    "metrics-maintain": {"task": "serving.tasks.metrics_maintain_tick", "schedule": 60.0},
    "autoscaler": {
        "task": "rollouts.tasks.autoscaler_tick",
        "schedule": AUTOSCALER_INTERVAL_S,
        "options": {"expires": AUTOSCALER_INTERVAL_S},  # as the judge's: the next tick reads fresher beats
    },
}
# Started by the `serve` command when there is no Redis (so no Celery beat): the same tasks, in-process.
EMBEDDED_SCHEDULER_STARTER = "config.periodic.start_embedded_scheduler"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = STATE_DIR / "static"
SERVE_STATIC = _env_bool("SWITCHYARD_SERVE_STATIC", not IS_PRODUCTION)
STATICFILES_DIRS = [BASE_DIR / "static"]
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "dashboard.finders.PlotlyJsFinder",  # plotly.js from the plotly package: no CDN, no vendored copy
]
LOGIN_URL = "/admin/login/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "registry.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": [
        "registry.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    # JSON only: with DRF's browsable API, a client that asked for text/html (a browser, a misconfigured
    # SDK) got its errors as an HTML page, not the one JSON error shape every /v1/ answer has.
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "registry.errors.drf_exception_handler",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Switchyard API",
    "DESCRIPTION": "Model registry, inference and rollouts.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "serving.edge.schema.add_inference_paths",
    ],
}

# --- Switchyard ---
ARTIFACT_ROOT = Path(os.environ.get("ARTIFACT_ROOT", STATE_DIR / "artifacts"))
# Where POST /v1/models/{model}/versions may copy a model directory from: the body names a directory under
# it, and a path that leads outside (.., an absolute path, a symbolic link) is refused. What is copied is
# checked as `manage.py register_model` checks it (registry/artifacts.py).
ARTIFACT_IMPORT_ROOT = Path(os.environ.get("SWITCHYARD_ARTIFACT_IMPORT_ROOT", STATE_DIR / "imports"))
# Limits checked at the edge, before any model work.
MAX_INPUT_CHARS = int(os.environ.get("SWITCHYARD_MAX_INPUT_CHARS", "32768"))
MAX_REQUEST_BYTES = int(os.environ.get("SWITCHYARD_MAX_REQUEST_BYTES", str(256 * 1024)))
MAX_TOKENS_LIMIT = int(os.environ.get("SWITCHYARD_MAX_TOKENS_LIMIT", "4096"))
# A response_format's JSON schema, as compact JSON: past this it is refused before it is compiled
# (serving/edge/response_format.py); the grammar of one this size still compiles in milliseconds.
MAX_RESPONSE_SCHEMA_BYTES = int(os.environ.get("SWITCHYARD_MAX_RESPONSE_SCHEMA_BYTES", str(64 * 1024)))
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES
# The HTTP server's own limits (serving/edge/http_limits.py): a request line and headers past these are
# answered 431 unread; headers that take longer than EDGE_HEADER_TIMEOUT_S to arrive, 408; a body that
# takes longer than EDGE_BODY_TIMEOUT_S after its headers ends the connection. Past EDGE_MAX_CONNECTIONS
# concurrent connections a new request gets a 503.
EDGE_MAX_HEADERS = int(os.environ.get("SWITCHYARD_EDGE_MAX_HEADERS", "100"))
EDGE_MAX_HEADER_BYTES = int(os.environ.get("SWITCHYARD_EDGE_MAX_HEADER_BYTES", str(32 * 1024)))
EDGE_HEADER_TIMEOUT_S = float(os.environ.get("SWITCHYARD_EDGE_HEADER_TIMEOUT_S", "10"))
EDGE_BODY_TIMEOUT_S = float(os.environ.get("SWITCHYARD_EDGE_BODY_TIMEOUT_S", "30"))
EDGE_MAX_CONNECTIONS = int(os.environ.get("SWITCHYARD_EDGE_MAX_CONNECTIONS", "2000"))
# Failed sign-ins (API keys per client address and key prefix; the staff login per address and user name):
# past AUTH_FAILURE_LIMIT within AUTH_FAILURE_WINDOW_S, 429 with Retry-After (registry/auth_throttle.py).
AUTH_FAILURE_LIMIT = int(os.environ.get("SWITCHYARD_AUTH_FAILURE_LIMIT", "10"))
AUTH_FAILURE_WINDOW_S = float(os.environ.get("SWITCHYARD_AUTH_FAILURE_WINDOW_S", "60"))
# SIGTERM to the web process: no new connections or requests; streams in flight run on for up to this
# long, then those still open end with a final error event (serving/management/commands/serve.py).
SHUTDOWN_DRAIN_S = float(os.environ.get("SWITCHYARD_SHUTDOWN_DRAIN_S", "30"))
# A replica's step running longer than this is taken for hung: the replica fails, ends its requests with a
# terminal error and exits (run_replica) or is replaced (embedded). 0 turns the watchdog off.
REPLICA_STEP_WATCHDOG_S = float(os.environ.get("SWITCHYARD_REPLICA_STEP_WATCHDOG_S", "60"))
# A WebSocket that has not authenticated (a header at the handshake, or its first auth message) this
# long after it opened is closed with 4401 (serving/edge/websocket.py).
WS_AUTH_DEADLINE_S = float(os.environ.get("SWITCHYARD_WS_AUTH_DEADLINE_S", "10"))
# A stream whose client has this many events unread beyond what the sockets hold is cut off and its
# sequence aborted (serving/transport/reply_hub.py).
STREAM_MAX_BACKLOG_EVENTS = int(os.environ.get("SWITCHYARD_STREAM_MAX_BACKLOG_EVENTS", "256"))
# While the registry database cannot be read, an API key that passed its check this recently still
# passes (serving/gateway/auth.py): the data plane keeps serving the tenants it has seen through a
# control-plane outage. 0 turns that off: every key not checked in the last few seconds gets a 503.
AUTH_STALE_S = float(os.environ.get("SWITCHYARD_AUTH_STALE_S", "3600"))
if AUTH_STALE_S < 0:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SWITCHYARD_AUTH_STALE_S must be 0 (off) or a number of seconds")
# The embedded runtime: in-process replicas supervised from the server's event loop.
EMBEDDED_REPLICAS = _env_bool("SWITCHYARD_EMBEDDED_REPLICAS", not REDIS_URL)
REPLICA_SYNC_INTERVAL_S = float(os.environ.get("SWITCHYARD_REPLICA_SYNC_INTERVAL_S", "2"))
# An embedded replica whose version has no traffic (it lost it, or it was started for a pinned request) is
# kept while it has taken a request within this long: undoing a promotion is then a routing edit, and a
# pinned version stays loaded while it is used (serving/replica/supervisor.py).
REPLICA_KEEP_WARM_S = float(os.environ.get("SWITCHYARD_REPLICA_KEEP_WARM_S", "300"))
# The most embedded replicas started for pinned requests (versions without traffic) at once; a pin past it
# is a 503, as before (serving/replica/supervisor.py).
REPLICA_MAX_PINNED = int(os.environ.get("SWITCHYARD_REPLICA_MAX_PINNED", "2"))
# With replica processes: the most versions without traffic the autoscaler gives a replica for pinned
# requests at once, each kept until AUTOSCALER idle_before_zero_s after its last (rollouts/scaling.py).
PROVISIONER_MAX_PINNED = int(os.environ.get("SWITCHYARD_PROVISIONER_MAX_PINNED", "2"))
# How long run_replica's drain may run after SIGTERM before it ends what it still holds with an error
# (a gateway retries a request with no token yet elsewhere) and exits: under both supervisors' kill at
# 600 s (the provisioner's drain_timeout_s, the Kubernetes grace period), so the streams end cleanly and
# the metrics are flushed. 0: no deadline. Override per process with --drain-timeout.
REPLICA_DRAIN_TIMEOUT_S = float(os.environ.get("SWITCHYARD_DRAIN_TIMEOUT_S", "570"))
# Engine sizing per replica (override per process with run_replica's flags).
REPLICA_MAX_NUM_SEQS = int(os.environ.get("SWITCHYARD_MAX_NUM_SEQS", "64"))
REPLICA_MAX_NUM_BATCHED_TOKENS = int(os.environ.get("SWITCHYARD_MAX_NUM_BATCHED_TOKENS", "512"))
REPLICA_MAX_LORAS = int(os.environ.get("SWITCHYARD_MAX_LORAS", "8"))  # LoRA adapters a replica keeps loaded
REPLICA_MAX_LORA_RANK = int(os.environ.get("SWITCHYARD_MAX_LORA_RANK", "64"))  # and their highest rank
# The KV cache: SWITCHYARD_KV_CACHE_MB if set; else, as vLLM sizes it, a share of the GPU's free memory
# after the weights are loaded (SWITCHYARD_GPU_MEMORY_FRACTION), or on a CPU a share of the host memory
# available (SWITCHYARD_CPU_MEMORY_FRACTION), at most what max_num_seqs sequences at the model's whole
# context fill (serving/engine/kv_budget.py).
_kv_cache_mb = os.environ.get("SWITCHYARD_KV_CACHE_MB", "").strip()
REPLICA_KV_CACHE_BYTES = int(_kv_cache_mb) * 1024 * 1024 if _kv_cache_mb else None
REPLICA_GPU_MEMORY_FRACTION = float(os.environ.get("SWITCHYARD_GPU_MEMORY_FRACTION", "0.8"))
if not 0 < REPLICA_GPU_MEMORY_FRACTION <= 1:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SWITCHYARD_GPU_MEMORY_FRACTION must be a share in (0, 1]")
REPLICA_CPU_MEMORY_FRACTION = float(os.environ.get("SWITCHYARD_CPU_MEMORY_FRACTION", "0.5"))
if not 0 < REPLICA_CPU_MEMORY_FRACTION <= 1:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SWITCHYARD_CPU_MEMORY_FRACTION must be a share in (0, 1]")
REPLICA_COMPILE = _env_bool("SWITCHYARD_COMPILE", False)
# Per-tenant caps inside a replica, so one tenant cannot hold a whole batch or cache (unset: none; the
# scheduler's fair order across tenants applies either way).
_tenant_running = os.environ.get("SWITCHYARD_MAX_RUNNING_PER_TENANT", "").strip()
REPLICA_MAX_RUNNING_PER_TENANT = int(_tenant_running) if _tenant_running else None
_tenant_kv = os.environ.get("SWITCHYARD_MAX_KV_SHARE_PER_TENANT", "").strip()
REPLICA_MAX_KV_SHARE_PER_TENANT = float(_tenant_kv) if _tenant_kv else None  # a share of the KV blocks
# A waiting flex request is promoted to the default tier after this many seconds (0: never), and then
# competes with default ones by age (serving/engine/tiers.py). Tenants' quota caps override the two above.
REPLICA_TIER_AGING_S = float(os.environ.get("SWITCHYARD_REPLICA_TIER_AGING_S", "10"))
# A request that has waited this long in a replica's queue without a seat ends with `queue_timeout` (a 503
# with Retry-After when not streaming) rather than waiting on in silence; 0: never.
REPLICA_QUEUE_TIMEOUT_S = float(os.environ.get("SWITCHYARD_REPLICA_QUEUE_TIMEOUT_S", "60"))
if REPLICA_MAX_KV_SHARE_PER_TENANT is not None and not 0 < REPLICA_MAX_KV_SHARE_PER_TENANT <= 1:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SWITCHYARD_MAX_KV_SHARE_PER_TENANT must be a share in (0, 1]")
# The dynamic batcher of non-generative models (embedding models and classifiers): a batch closes at this
# many inputs, or when its oldest input has waited this long, whichever comes first
# (serving/engine/batcher.py). Unset wait: 0 on a CPU, 5 ms on a GPU; unset size: 8 on a CPU, 32 on a GPU
# (serving/engine/encoder.py says why; `manage.py bench batching` measures them, docs/benchmarks.md).
_embed_batch = os.environ.get("SWITCHYARD_EMBED_MAX_BATCH_SIZE", "").strip()
REPLICA_EMBED_MAX_BATCH_SIZE = int(_embed_batch) if _embed_batch else None
_embed_wait_ms = os.environ.get("SWITCHYARD_EMBED_MAX_WAIT_MS", "").strip()
REPLICA_EMBED_MAX_WAIT_S = float(_embed_wait_ms) / 1000 if _embed_wait_ms else None
# fp32 on a CPU: Linear weights in oneDNN's format. Faster on some CPUs, slower on others
# (docs/benchmarks.md, "oneDNN-packed Linear layers"): "auto" (None) times both at load and packs only
# if it pays; 1 or 0 decides.
REPLICA_PACK_LINEAR = (
    None
    if os.environ.get("SWITCHYARD_PACK_LINEAR", "auto").strip().lower() == "auto"
    else _env_bool("SWITCHYARD_PACK_LINEAR", True)
)
# The engine's forward and attention (serving/engine/runner.py): "auto" takes the engine's own fused
# forward for the Llama family and the native paged attention kernel where each applies; "fused" or
# "native" refuse to start a replica without it; "generic" or "gather" turn them off.
REPLICA_FORWARD = os.environ.get("SWITCHYARD_FORWARD", "auto").strip().lower()
if REPLICA_FORWARD not in ("auto", "fused", "generic"):
    raise ImproperlyConfigured("SWITCHYARD_FORWARD must be auto, fused or generic")
REPLICA_ATTENTION = os.environ.get("SWITCHYARD_ATTENTION", "auto").strip().lower()
if REPLICA_ATTENTION not in ("auto", "native", "gather"):
    raise ImproperlyConfigured("SWITCHYARD_ATTENTION must be auto, native or gather")
# torch's intra-op threads (unset: every core). Replicas inside the server share the cores with its
# event loop, and still take them all: on 2 cores, one thread kept 59% of the engine alone's throughput
# through the API on a 64-stream load, two 80%, with the p50 TTFT the path adds at light load +3 ms
# (docs/benchmarks.md, "Engine step cost").
REPLICA_TORCH_THREADS = int(os.environ.get("SWITCHYARD_TORCH_THREADS", "0")) or None
EMBEDDED_TORCH_THREADS = os.cpu_count() or 1
# Python's GIL switch interval in a process that runs a replica (0: leave Python's 5 ms default).
REPLICA_GIL_SWITCH_INTERVAL_S = float(os.environ.get("SWITCHYARD_GIL_SWITCH_INTERVAL_MS", "1")) / 1000
# Rollouts: defaults for a deployment that does not say (thresholds: rollouts.judge.Thresholds).
ROLLOUT_DEFAULT_STEPS = [1, 5, 25, 100]
ROLLOUT_BAKE_SECONDS = int(os.environ.get("SWITCHYARD_ROLLOUT_BAKE_SECONDS", "60"))
ROLLOUT_THRESHOLDS: dict[str, float] = {
    "min_samples": 50,
    "ttft_sla_ms": 1000.0,
    "tpot_sla_ms": 100.0,
    "latency_ratio": 1.25,
    "alpha": 0.01,
    "min_rate_increase": 0.005,
    "min_output_length_ratio": 0.5,
    "min_truncation_increase": 0.05,
    "min_agreement": 0.0,  # a shadow candidate's mean share of agreeing tokens; 0: not judged
}
# This loop's data plane, started: () -> awaitable DataPlane (serving/gateway/data_plane.py). The gateway
# names the composition root here rather than importing it (docs/architecture.md, "Import rules").
DATA_PLANE = "serving.runtime.get_runtime"
# Where the judge reads a version's window: f(*, model_name, version, start, end) -> window (dotted path).
ROLLOUT_WINDOW_READER = os.environ.get("SWITCHYARD_ROLLOUT_WINDOW_READER", "serving.selectors.version_window")
# Is the candidate's replica ready? f(deployment) -> bool (dotted path; see rollouts.services).
ROLLOUT_READINESS_CHECK = "rollouts.services.candidate_is_ready"
ROLLOUT_PROVISION_TIMEOUT_S = int(os.environ.get("SWITCHYARD_ROLLOUT_PROVISION_TIMEOUT_S", "600"))
# The autoscaler's policy (rollouts/fleet/autoscaler.py): replicas per serving version, and the load each may
# carry before another is wanted; it scales down only after a whole window of lower recommendations.
AUTOSCALER = {
    "min_replicas": int(os.environ.get("SWITCHYARD_AUTOSCALER_MIN_REPLICAS", "1")),
    "max_replicas": int(os.environ.get("SWITCHYARD_AUTOSCALER_MAX_REPLICAS", "4")),
    "target_queue_per_replica": float(os.environ.get("SWITCHYARD_AUTOSCALER_TARGET_QUEUE", "2")),
    "target_saturation": float(os.environ.get("SWITCHYARD_AUTOSCALER_TARGET_SATURATION", "0.9")),
    "target_kv_usage": float(os.environ.get("SWITCHYARD_AUTOSCALER_TARGET_KV_USAGE", "0.8")),
    "warm_buffer": int(os.environ.get("SWITCHYARD_AUTOSCALER_WARM_BUFFER", "0")),
    "scale_down_window_s": float(os.environ.get("SWITCHYARD_AUTOSCALER_SCALE_DOWN_WINDOW_S", "120")),
    # For a model that scales to zero (`manage.py set_scaling MODEL --min 0`): no request for this long,
    # and its version keeps no replica.
    "idle_before_zero_s": float(os.environ.get("SWITCHYARD_AUTOSCALER_IDLE_BEFORE_ZERO_S", "300")),
    # The mean step time (each running sequence's TPOT) replicas are held at, under the rollout judge's
    # p99 TPOT SLA with room for the tail; 0 turns the step-time signal off (rollouts/fleet/autoscaler.py).
    "target_tpot_ms": float(os.environ.get("SWITCHYARD_AUTOSCALER_TARGET_TPOT_MS", "50")) or None,
}
if not 1 <= AUTOSCALER["min_replicas"] <= AUTOSCALER["max_replicas"]:
    from django.core.exceptions import ImproperlyConfigured

    # Scaling to zero is a model's own choice (set_scaling --min 0), never every model's by default.
    raise ImproperlyConfigured(
        "SWITCHYARD_AUTOSCALER_MIN_REPLICAS must be from 1 to ..._MAX_REPLICAS "
        "(scaling to zero is per model: manage.py set_scaling MODEL --min 0)"
    )
if AUTOSCALER["target_tpot_ms"] is not None and not 0 < AUTOSCALER["target_tpot_ms"] < math.inf:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SWITCHYARD_AUTOSCALER_TARGET_TPOT_MS: above 0, or 0 for no step-time signal")
if AUTOSCALER["idle_before_zero_s"] <= 0:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SWITCHYARD_AUTOSCALER_IDLE_BEFORE_ZERO_S must be above 0")
# How long a request for a version scaled to zero waits at the gateway for a replica to start (load and
# warm up) before it gets a 503.
COLD_START_TIMEOUT_S = float(os.environ.get("SWITCHYARD_COLD_START_TIMEOUT_S", "120"))
# Metrics: each replica flushes its 5 s windows to the store this often (seconds, at most 5).
METRICS_FLUSH_INTERVAL_S = float(os.environ.get("SWITCHYARD_METRICS_FLUSH_INTERVAL_S", "5"))
# /metrics lists every model and version this process serves, so it is not public: a staff session may
# read it, and a scraper with `Authorization: Bearer <this token>` (Prometheus' `authorization` block).
# Unset: staff sessions only. `run_replica --metrics-port` serves the same text under the same rule.
METRICS_TOKEN = os.environ.get("SWITCHYARD_METRICS_TOKEN", "").strip()
# Fault injection (serving/replica/faults.py), for demos and tests: refused unless DEBUG or explicitly
# allowed.
ALLOW_FAULT_INJECTION = _env_bool("SWITCHYARD_ALLOW_FAULT_INJECTION", False)
FAULTS = os.environ.get("SWITCHYARD_FAULTS", "").strip()  # "model:version=delay_ms:40,error_rate:0.2;…"
if FAULTS and not (DEBUG or ALLOW_FAULT_INJECTION):
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        "SWITCHYARD_FAULTS is set but fault injection is refused when DEBUG is off; "
        "set SWITCHYARD_ALLOW_FAULT_INJECTION=1 to allow it"
    )
# Prompts and completions are never logged unless sampled logging is turned on: then this share of
# requests goes, redacted, to the `switchyard.prompts` logger (serving/telemetry/prompt_log.py).
LOG_PROMPTS_SAMPLE_RATE = float(os.environ.get("SWITCHYARD_LOG_PROMPTS_SAMPLE_RATE", "0"))
if not 0 <= LOG_PROMPTS_SAMPLE_RATE <= 1:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SWITCHYARD_LOG_PROMPTS_SAMPLE_RATE must be a share from 0 to 1")
# With prompt logging on, shadow copies whose output differs from their primary's are drawn at that rate
# and kept, redacted as the prompt log is, up to this many per candidate version, for staff to read
# (serving/telemetry/shadow_pairs.py); 0 keeps none.
SHADOW_DIFF_PAIRS = int(os.environ.get("SWITCHYARD_SHADOW_DIFF_PAIRS", "20"))

SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
# With SECRET_KEY set, whatever DEBUG says: DEBUG=1 on a production host had turned HTTPS off as well.
# (A plain-HTTP setup with a key of its own turns each off by name.)
if IS_PRODUCTION:
    SESSION_COOKIE_SECURE = _env_bool("SESSION_COOKIE_SECURE", True)
    CSRF_COOKIE_SECURE = _env_bool("CSRF_COOKIE_SECURE", True)
    SECURE_SSL_REDIRECT = _env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", "31536000"))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    # Trusted: the proxy in front (platform/README.md) must set X-Forwarded-Proto on every request,
    # overwriting what a client sent.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # Health probes come from the orchestrator over plain HTTP inside the cluster.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]

# One line per request on the `switchyard.access` logger (config/access_log.py): method, path, status,
# duration, tenant; never a key, a query string or a body.
ACCESS_LOG = _env_bool("SWITCHYARD_ACCESS_LOG", True)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "filters": {"websocket_path_only": {"()": "config.log_filters.WebSocketPathOnly"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.request": {"level": "ERROR"},
        "uvicorn.error": {"filters": ["websocket_path_only"]},  # handshakes: no query strings (keys)
    },
}
