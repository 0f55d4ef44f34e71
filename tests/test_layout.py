"""The architecture's rules that a test can keep."""

import subprocess
import sys

from tests.conftest import REPO_ROOT

TOP_LEVEL_PACKAGES = [
    "config",
    "registry",
    "serving",
    "rollouts",
    "dashboard",
    "tests",
    "platform",
    "scripts",
]


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
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_policy_modules_import_no_torch() -> None:
    code = (
        "import sys, importlib\n"
        "for name in ('sequence', 'kv_cache', 'scheduler'):\n"
        "    try: importlib.import_module('serving.engine.' + name)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        if exc.name != 'serving.engine.' + name: raise\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


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
