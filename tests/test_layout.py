"""The architecture's rules that a test can keep."""

import ast
import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.import_graph import Import, is_under, read_graph

TOP_LEVEL_PACKAGES = [
    "config",
    "audit",
    "registry",
    "serving",
    "rollouts",
    "dashboard",
    "tests",
    "platform",
    "scripts",
]


def _python_prints(code: str) -> str:
    """What `code` prints, run in a fresh interpreter from the repository's root."""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_no_top_level_package_shadows_the_standard_library() -> None:
    python_packages = [p for p in TOP_LEVEL_PACKAGES if (REPO_ROOT / p / "__init__.py").exists()]
    assert "platform" not in python_packages  # a directory of notes, never a package
    assert not set(python_packages) & sys.stdlib_module_names


def test_the_engine_imports_without_django_channels_or_celery() -> None:
    code = (
        "import sys, serving.engine.sequence, serving.engine.detokenizer\n"
        "import importlib, pkgutil, serving.engine as e\n"
        "for m in pkgutil.iter_modules(e.__path__): importlib.import_module('serving.engine.' + m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in {'django', 'channels', 'celery', 'registry', "
        "'rollouts', 'dashboard', 'config'}]\n"
        "print(','.join(bad))\n"
    )
    assert _python_prints(code) == ""


def test_policy_modules_import_no_torch() -> None:
    code = (
        "import sys, importlib\n"
        "for name in ('sequence', 'kv_cache', 'scheduler'):\n"
        "    try: importlib.import_module('serving.engine.' + name)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        if exc.name != 'serving.engine.' + name: raise\n"
        "print('torch' in sys.modules)\n"
    )
    assert _python_prints(code) == "False"


def test_serving_init_stays_empty() -> None:
    assert (REPO_ROOT / "serving" / "__init__.py").read_text().strip() == ""


def test_manage_py_check_is_clean() -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--fail-level", "WARNING"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_the_deploy_checks_pass_with_production_settings(tmp_path: Path) -> None:
    """Django's deployment checklist (HTTPS, HSTS, secure cookies, the secret's strength, DEBUG off) on
    the settings a production environment gets: SECRET_KEY set, which turns the HTTPS-only defaults on."""
    env = {
        **os.environ,
        "SECRET_KEY": secrets.token_urlsafe(50),
        "SWITCHYARD_STATE_DIR": str(tmp_path),
        "ALLOWED_HOSTS": "switchyard.example.com",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr


# --- the import rules (docs/architecture.md, "Import rules") ---------------------------------------------

GRAPH = read_graph(REPO_ROOT)
GATEWAY_SIDE = ("serving.gateway", "serving.edge")
REPLICA_SIDE = ("serving.replica", "serving.engine")
# Entry points compose the whole process, as the runtime does: they may import either side.
ENTRY_POINTS = ("serving.management", "rollouts.management", "registry.management", "dashboard.management")
SHARED_LEAVES = ("serving.cancelling", "serving.throttle", "serving.models", "serving.selectors")


def _violations(rule: Callable[[Import], bool]) -> list[str]:
    return sorted(f"{i.source}:{i.line} imports {i.target}" for i in GRAPH.imports if rule(i))


def test_the_project_has_no_import_cycle() -> None:
    assert GRAPH.cycles() == []


def test_the_gateway_side_never_imports_the_replica_side_nor_the_root() -> None:
    # serving/edge/probes.py alone asks the root for readiness: it is about the process as a whole.
    def breaks(i: Import) -> bool:
        return (
            is_under(i.source, *GATEWAY_SIDE)
            and i.source != "serving.edge.probes"
            and is_under(i.target, *REPLICA_SIDE, "serving.runtime")
        )

    assert _violations(breaks) == []


def test_no_chain_of_imports_leads_from_the_gateway_to_the_replica_side() -> None:
    reached = {
        module: sorted(m for m in GRAPH.reachable(module) if is_under(m, *REPLICA_SIDE, "serving.runtime"))
        for module in GRAPH.modules
        if is_under(module, *GATEWAY_SIDE) and module != "serving.edge.probes"
    }
    assert {module: chain for module, chain in reached.items() if chain} == {}


def test_the_edge_reaches_transport_through_the_protocol_only() -> None:
    def breaks(i: Import) -> bool:
        return (
            is_under(i.source, "serving.edge")
            and is_under(i.target, "serving.transport")
            and i.target not in ("serving.transport.protocol", "serving.transport.vectors")
        )

    assert _violations(breaks) == []


def test_the_replica_side_never_imports_the_gateway_side() -> None:
    def breaks(i: Import) -> bool:
        return is_under(i.source, *REPLICA_SIDE) and is_under(i.target, *GATEWAY_SIDE, "serving.runtime")

    assert _violations(breaks) == []


def test_the_protocol_imports_the_standard_library_only() -> None:
    tree = ast.parse((REPO_ROOT / "serving" / "transport" / "protocol.py").read_text())
    roots = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert roots - {"__future__"} <= sys.stdlib_module_names


def test_transport_and_telemetry_import_no_side() -> None:
    def breaks(i: Import) -> bool:
        return is_under(i.source, "serving.transport", "serving.telemetry") and is_under(
            i.target, *GATEWAY_SIDE, *REPLICA_SIDE, "serving.runtime"
        )

    assert _violations(breaks) == []


def test_other_apps_read_serving_through_its_selectors() -> None:
    # The fleet simulator runs the real scheduler, replica choice and TTFT forecast on a virtual clock:
    # it may import the engine, the pieces of the gateway it simulates (pure functions, no Django) and
    # the heartbeat's figures.
    simulation = ("rollouts.fleet.simulator", "rollouts.fleet.slo_gateway")
    simulated = (
        "serving.engine",
        "serving.gateway.router",
        "serving.gateway.ttft_forecast",
        "serving.transport.replica_directory",
        "serving.transport.step_rate",
    )

    def breaks(i: Import) -> bool:
        if not is_under(i.source, "rollouts", "dashboard") or is_under(i.source, *ENTRY_POINTS):
            return False
        if i.source in simulation and is_under(i.target, *simulated):
            return False
        return is_under(i.target, "serving") and not is_under(i.target, *SHARED_LEAVES)

    assert _violations(breaks) == []


def test_apps_import_only_downward() -> None:
    # config -> dashboard -> rollouts -> serving -> registry -> audit
    order = ["audit", "registry", "serving", "rollouts", "dashboard", "config"]

    def breaks(i: Import) -> bool:
        source_app, target_app = i.source.split(".")[0], i.target.split(".")[0]
        if is_under(i.source, *ENTRY_POINTS):
            return False
        return order.index(target_app) > order.index(source_app)

    assert _violations(breaks) == []


def test_a_function_local_import_says_why_it_is_deferred() -> None:
    # Only to defer a heavy or not-yet-loadable dependency, never to dodge a cycle. Entry points and
    # benchmarks defer their imports as a rule (a command loads only what it runs).
    def breaks(i: Import) -> bool:
        return (
            i.is_local and not i.has_comment and not is_under(i.source, *ENTRY_POINTS, "serving.benchmarks")
        )

    assert _violations(breaks) == []


def test_importing_the_gateway_and_the_edge_loads_no_torch() -> None:
    code = (
        "import os, sys, django\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'config.settings')\n"
        "django.setup()\n"
        "import serving.gateway.dispatch, serving.edge.openai_api, serving.edge.infer_api\n"
        "import serving.edge.websocket\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    assert _python_prints(code) == "[]"


def test_every_dotted_path_in_settings_names_something_real() -> None:
    # No import graph sees these: a move that renames one breaks only at run time.
    from django.conf import settings
    from django.utils.module_loading import import_string

    from config.periodic import resolve_task

    paths = [
        settings.EMBEDDED_SCHEDULER_STARTER,
        settings.DATA_PLANE,
        settings.ROLLOUT_READINESS_CHECK,
        settings.ROLLOUT_WINDOW_READER,
        *settings.MIDDLEWARE,
        *(layer["BACKEND"] for layer in settings.CHANNEL_LAYERS.values()),
        *settings.SPECTACULAR_SETTINGS.get("POSTPROCESSING_HOOKS", []),
    ]
    for path in paths:
        assert import_string(path) is not None, path
    for entry in settings.CELERY_BEAT_SCHEDULE.values():
        assert resolve_task(entry["task"]) is not None, entry["task"]


# --- sizes (docs/architecture.md, "Where each concept lives") ----------------------------------------------

MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
# What may stay over the limits for now, each to be split: the test fails if one grows, if a new one
# appears, or if one listed here has come under its limit (then take it off the list). Empty: nothing is.
OVERSIZED: dict[str, int] = {}


def _sizes() -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path in GRAPH.modules.values():
        source = path.read_text()
        relative = str(path.relative_to(REPO_ROOT))
        sizes[relative] = source.count("\n")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                sizes[f"{relative}:{node.name}"] = (node.end_lineno or node.lineno) - node.lineno + 1
    return sizes


def test_modules_and_classes_stay_within_their_size() -> None:
    over = {
        name: size
        for name, size in _sizes().items()
        if size > (MAX_CLASS_LINES if ":" in name else MAX_MODULE_LINES) and size > OVERSIZED.get(name, 0)
    }
    assert over == {}


def test_the_oversized_list_names_only_what_is_still_over() -> None:
    sizes = _sizes()
    assert {
        name: sizes.get(name, 0)
        for name in OVERSIZED
        if sizes.get(name, 0) <= (MAX_CLASS_LINES if ":" in name else MAX_MODULE_LINES)
    } == {}
