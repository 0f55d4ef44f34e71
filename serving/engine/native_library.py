"""The engine's C library (csrc/*.c): built with the machine's C compiler at first use, cached on disk,
loaded through ctypes once per process. native_attention.py and native_ops.py call into it.

Built once per source, compiler and CPU (`-march=native`), in about a second, into
`$SWITCHYARD_KERNEL_CACHE` (default `~/.cache/switchyard/kernels`). With no C compiler, or off Linux,
`load_library` says why and the engine keeps torch's own operators.

OpenMP: the library links libgomp by its soname, which torch's own libgomp carries, so its parallel
loops run on torch's thread pool rather than a second one competing for the same cores. ctypes releases
the GIL for each call."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).with_name("csrc")
# -ffp-contract=fast: in ISO C mode GCC fuses no multiply-add into an FMA instruction unless told to
# (Clang does by default); with them the attention of a batch-64 decode step took ~7% less time on a
# Zen 4 EPYC (docs/architecture.md, "The kernel asks for the next block as it goes").
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11")


class KernelUnavailable(RuntimeError):
    """The C library cannot be built or loaded here; the message says why."""


def sources(directory: Path = SOURCE_DIR) -> list[Path]:
    return sorted(directory.glob("*.c"))


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelUnavailable("no C compiler found (set CC, or install gcc)")


def _cache_dir() -> Path:
    configured = os.environ.get("SWITCHYARD_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "switchyard" / "kernels"


def _cpu_identity() -> str:
    # -march=native builds for this CPU; a cache shared by machines must not hand one another's build.
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_library(
    *,
    source_files: list[Path] | None = None,
    cache_dir: Path | None = None,
    extra_flags: tuple[str, ...] = (),
) -> Path:
    """The compiled library's path, compiling it first unless an identical build is cached. `extra_flags`
    follow COMPILE_FLAGS (the tests build the narrower vector widths of CPUs other than this one)."""
    compiler = _compiler()
    flags = [*COMPILE_FLAGS, *extra_flags]  # what the build runs with, and so part of its cache key
    files = source_files if source_files is not None else sources()
    headers = sorted({header for path in files for header in path.parent.glob("*.h")})
    source = b"\0".join(path.read_bytes() for path in [*files, *headers])  # what the build reads
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from exc
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(flags).encode(),
                version.encode(),
                _cpu_identity().encode(),
            ]
        )
    ).hexdigest()[:20]
    directory = cache_dir or _cache_dir()
    target = directory / f"switchyard-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed into place: two processes building at once each rename a whole file.
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, "-o", str(built), *map(str, files), "-lm"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except subprocess.SubprocessError as exc:  # a compiler that hangs: unavailable, not a crash
            raise KernelUnavailable(f"{' '.join(command)} failed: {exc}") from exc
        if result.returncode != 0:
            raise KernelUnavailable(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


def load_library() -> ctypes.CDLL:
    """The library, built if needed; raises KernelUnavailable saying why not. Tried once per process:
    a failure is remembered, not retried by every engine that asks."""
    library, reason = _load_once()
    if library is None:
        raise KernelUnavailable(reason)
    return library


@functools.cache
def _load_once() -> tuple[ctypes.CDLL | None, str]:
    if platform.system() != "Linux":
        return None, f"built and tested on Linux only, not {platform.system()}"
    try:
        return ctypes.CDLL(str(build_library())), ""
    except KernelUnavailable as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot build or load the kernels: {exc}"
