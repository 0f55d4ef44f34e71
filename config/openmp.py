"""Which OpenMP runtime runs the engine's parallel loops in the commands that run engines.

torch's CPU wheel and the engine's native kernel run their parallel loops on GNU OpenMP (libgomp). In a
serving process the engine's threads share the cores with the event loop (and, on a small machine, with
whatever else runs there); a thread of a parallel region that is preempted holds up every other at the
region's barrier, and GNU OpenMP's waiting threads spin without giving way. Intel OpenMP (libiomp5, the
`intel-openmp` package; vLLM's CPU build asks for it too) implements the same interface and gives the
cores back while it waits: through the API the platform keeps markedly more of the engine's throughput
with it (docs/architecture.md, "Intel OpenMP in the serving processes"; the figures in
docs/benchmarks.md).

It has to be preloaded (LD_PRELOAD) before the interpreter starts, so manage.py calls
`exec_under_intel_openmp` before anything else: for the commands that run an engine it starts the
same command line again with the library preloaded. SWITCHYARD_OPENMP=gnu keeps GNU OpenMP; where the
library is not installed (it is only for Linux on x86-64) nothing changes."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

LIBRARY_NAME = "libiomp5.so"
# manage.py commands that run an engine in their own process (bench runs the platform in-process).
ENGINE_COMMANDS = frozenset({"serve", "run_replica", "bench"})
SETTING = "SWITCHYARD_OPENMP"  # "intel" (the default where installed) or "gnu"
# How long (ms) a thread that finished its part of a parallel region waits for the next before it sleeps:
# vLLM's value for its CPU workers, and the best measured here (64 PEERS-shaped streams through the API,
# medians of 4-8 runs: 0 ms 1,110 output tok/s, 2 ms 1,209, 5 ms 1,313, 10 ms 1,274, 20 ms 1,225, the
# runtime's own 200 ms 1,270). Shorter, every region pays a wake-up; longer, waiting threads keep the
# cores the event loop needs.
BLOCKTIME_MS = "5"


def intel_openmp_library(prefix: str = sys.prefix) -> Path | None:
    """The library the `intel-openmp` package installed into this environment, if it did."""
    path = Path(prefix) / "lib" / LIBRARY_NAME
    return path if path.is_file() else None


def _preloaded(environ: Mapping[str, str]) -> list[str]:
    """LD_PRELOAD's entries (the dynamic loader takes spaces or colons between them)."""
    return environ.get("LD_PRELOAD", "").replace(":", " ").split()


def preloads(environ: Mapping[str, str], library: Path) -> bool:
    return str(library) in _preloaded(environ)


def wants_intel_openmp(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether this manage.py command line should run under Intel OpenMP."""
    if environ.get(SETTING, "intel").strip().lower() == "gnu":
        return False
    return len(argv) > 1 and argv[1] in ENGINE_COMMANDS


def environment_with(environ: Mapping[str, str], library: Path) -> dict[str, str]:
    """`environ` with the library preloaded ahead of anything already preloaded, and its wait set unless
    the environment sets one."""
    env = dict(environ)
    env["LD_PRELOAD"] = " ".join([str(library), *_preloaded(environ)])
    env.setdefault("KMP_BLOCKTIME", BLOCKTIME_MS)
    return env


def exec_under_intel_openmp(argv: Sequence[str]) -> None:
    """Start this process's command line again under Intel OpenMP, where it should and can; returns only
    where it does not (already preloaded, not an engine command, switched off, or not installed). The
    process keeps its id, so whatever started it (a supervisor, a test) still holds it."""
    library = intel_openmp_library()
    if library is None or not wants_intel_openmp(argv, os.environ) or preloads(os.environ, library):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # orig_argv keeps the interpreter's own options (-u, -X …) as well as the script's arguments.
    os.execve(sys.executable, list(sys.orig_argv), environment_with(os.environ, library))


def runtime_in_use() -> str:
    """Which OpenMP runtime this process has loaded ("intel" or "gnu"), as its memory map says."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "gnu"
    return "intel" if LIBRARY_NAME in maps else "gnu"
