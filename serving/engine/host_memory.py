"""How the engine takes host memory on a CPU: the KV pool as zero pages without huge pages, and glibc's
allocator set to keep the memory a CPU step frees, instead of handing it back to the kernel.

The KV pool (`zero_pages`) is an anonymous mapping, whose pages the kernel maps in, zeroed, when first
written: a replica's KV budget costs memory as its sequences fill it, not at start (writing every page
up front took ~0.1 s and all of the budget's memory for a 512 MiB pool on a Zen 4 VM; 1.1 s on an earlier
machine). It is advised against transparent huge pages. numpy's zeros, which made the pool before, asks
for them on large arrays; where the kernel has to compact memory to find one (THP `defrag` set to
`madvise`, Debian's default) the first write to a fresh 2 MiB took milliseconds, and a decode step's
write of its new keys (into fresh blocks) stalled both of the attention kernel's threads. On 4 KiB pages
a first write costs ~1.8 µs a page, steadily; `bench engine` made 6% more tokens a second (medians of four
alternated runs, docs/architecture.md, "The KV pool's pages").

The allocator:

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
import math
import mmap
import platform

import numpy as np
import torch

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


def zero_pages(shape: tuple[int, ...]) -> torch.Tensor:
    """An fp32 tensor of zeros whose pages are mapped in when first written, never as huge pages."""
    count = math.prod(shape)
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not a POSIX system: calloc's zero pages
        return torch.from_numpy(np.zeros(shape, dtype=np.float32))
    mapping = mmap.mmap(-1, max(1, count) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    # The array holds the mapping (its buffer) for as long as the tensor holds the array.
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.float32, count=count).reshape(shape))
