"""glibc's allocator set to keep the memory a CPU step frees, instead of handing it back to the kernel.

A step's activations are tens of megabytes (a 2,048-token prefill of the bench model allocates a 22 MB
gate/up product in each layer), freed at the step's end. glibc returns such memory to the kernel (its
heap top is trimmed past 128 KiB, or the block was mmap'd on its own), so the next step takes every
page again by page fault: 21,000-26,000 faults per prefill step, which made it 430-445 ms instead of
281-285 ms (docs/benchmarks.md, "Engine step cost"). vLLM's CPU guide asks for tcmalloc through
LD_PRELOAD for the same reason; this needs no preload and no package.

Two settings, for the whole process (an embedded server's replica shares it with the web server):
a trim threshold so high that the heap is not given back, and a top pad, so that the heap grows by
enough at once that large allocations come from it rather than from mmap calls of their own. Memory
stays at the peak of a step's use. Elsewhere than glibc on Linux nothing is changed."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 256 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed memory (once per process); False where it is not glibc's."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        is_set = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and bool(
            libc.mallopt(M_TOP_PAD, TOP_PAD_BYTES)
        )
    except (OSError, AttributeError):
        return False
    if not is_set:
        logger.warning("glibc refused the allocator settings; CPU steps will page-fault their activations")
    return is_set
