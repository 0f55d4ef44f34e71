"""The engine commands run under Intel OpenMP where it is installed (config/openmp.py), and the engine's
kernels stay exact under it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from config.openmp import (
    BLOCKTIME_MS,
    SETTING,
    environment_with,
    intel_openmp_library,
    preloads,
    wants_intel_openmp,
)
from serving.benchmarks.serve_platform import platform_env

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = intel_openmp_library()
needs_library = pytest.mark.skipif(LIBRARY is None, reason="intel-openmp is installed on Linux x86-64 only")


@pytest.mark.parametrize("command", ["serve", "run_replica", "bench"])
def test_engine_commands_want_it(command: str) -> None:
    assert wants_intel_openmp(["manage.py", command, "--port", "8000"], {})


@pytest.mark.parametrize("argv", [["manage.py"], ["manage.py", "migrate"], ["manage.py", "seed_demo"]])
def test_other_commands_start_as_they_are(argv: list[str]) -> None:
    assert not wants_intel_openmp(argv, {})


def test_switched_off_by_the_setting() -> None:
    assert not wants_intel_openmp(["manage.py", "serve"], {"SWITCHYARD_OPENMP": "GNU"})
    assert wants_intel_openmp(["manage.py", "serve"], {"SWITCHYARD_OPENMP": "intel"})


def test_environment_keeps_what_was_preloaded_and_a_wait_set_by_the_user() -> None:
    library = Path("/opt/x/lib/libiomp5.so")
    env = environment_with({"LD_PRELOAD": "/a.so:/b.so", "KMP_BLOCKTIME": "0", "HOME": "/h"}, library)
    assert env["LD_PRELOAD"] == "/opt/x/lib/libiomp5.so /a.so /b.so"
    assert env["KMP_BLOCKTIME"] == "0" and env["HOME"] == "/h"
    assert preloads(env, library)
    assert environment_with({}, library)["KMP_BLOCKTIME"] == BLOCKTIME_MS
    assert not preloads({"LD_PRELOAD": "/a.so"}, library)


_PROBE = """
import os, sys
from config.openmp import exec_under_intel_openmp, runtime_in_use
exec_under_intel_openmp(["manage.py", sys.argv[1]])
print(os.getpid(), runtime_in_use(), os.environ.get("KMP_BLOCKTIME"))
"""


def _probe(command: str, **env: str) -> tuple[int, list[str]]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SWITCHYARD_OPENMP", "KMP_BLOCKTIME")
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROBE, command],
        cwd=ROOT,
        env={**clean, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return proc.pid, out.split()


@needs_library
def test_an_engine_command_starts_again_under_it_in_the_same_process() -> None:
    pid, (printed_pid, runtime, blocktime) = _probe("serve")
    assert (int(printed_pid), runtime, blocktime) == (pid, "intel", BLOCKTIME_MS)


@needs_library
def test_other_commands_and_the_setting_keep_gnu_openmp() -> None:
    assert _probe("migrate")[1][1] == "gnu"
    assert _probe("serve", SWITCHYARD_OPENMP="gnu")[1][1] == "gnu"


@needs_library
def test_the_native_kernels_and_the_fused_forward_stay_exact_under_it() -> None:
    """The paged attention against dense attention (fp32 ≤ 1e-5, hypothesis) and the fused Llama forward's
    greedy output against transformers' generate, in a process with Intel OpenMP preloaded: the kernel's
    `omp` pragmas then run on that runtime, as they do in `manage.py serve`."""
    assert LIBRARY is not None
    env = environment_with({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, LIBRARY)
    tests = ["tests/serving/engine/test_native_attention.py", "tests/serving/engine/test_fused_llama.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_a_benchmarks_throwaway_platform_runs_on_the_benchmarks_runtime(monkeypatch, tmp_path) -> None:
    """`SWITCHYARD_OPENMP=gnu manage.py bench serve --compare`: the engine alone (in the bench process) and
    the platform it starts on one runtime, while the shell's other settings stay out."""
    monkeypatch.setenv("SWITCHYARD_OPENMP", "gnu")
    monkeypatch.setenv("SWITCHYARD_MAX_NUM_SEQS", "3")
    env = platform_env(tmp_path)
    assert env[SETTING] == "gnu"
    assert "SWITCHYARD_MAX_NUM_SEQS" not in env
