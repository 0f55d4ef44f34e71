"""A safetensors file's header, read and checked without loading a tensor: 8 bytes of little-endian
header length, the JSON header (each tensor's dtype, shape and byte offsets in the data that follows),
then the data. Registration refuses a file whose header does not hold together (a pickle renamed
`model.safetensors` was accepted before and failed only when a replica loaded it), so that what the
registry holds is what a replica can load."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

# Bytes per element of each dtype safetensors defines.
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# safetensors' own bound on the header: a larger length is a file of another kind, not a big model.
MAX_HEADER_BYTES = 100_000_000


class SafetensorsHeaderError(ValueError):
    """The file is not a well-formed safetensors file; the message says what is wrong, in one line."""


def check_safetensors(path: Path) -> int:
    """Check `path`'s header against its size; return how many tensors it holds. Raises
    SafetensorsHeaderError."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsHeaderError("shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise SafetensorsHeaderError("its header length does not fit the file (not safetensors)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise SafetensorsHeaderError("its header is not JSON (not safetensors)") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError("its header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise SafetensorsHeaderError("its __metadata__ is not a map of strings")
    spans = sorted(_span(name, entry) for name, entry in header.items())
    expected = 0
    for begin, end, name in spans:
        if begin != expected:
            raise SafetensorsHeaderError(f"tensor {name!r} does not start where the one before it ends")
        expected = end
    if expected != size - 8 - header_len:
        raise SafetensorsHeaderError("its tensors do not cover the file's data exactly")
    return len(spans)


def tensor_shapes(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's dtype and shape, from a header check_safetensors has passed (it is checked again)."""
    check_safetensors(path)
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return {name: (entry["dtype"], list(entry["shape"])) for name, entry in header.items()}


def _span(name: str, entry: object) -> tuple[int, int, str]:
    if not isinstance(entry, dict):
        raise SafetensorsHeaderError(f"tensor {name!r} has no dtype, shape and offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise SafetensorsHeaderError(f"tensor {name!r} has an unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise SafetensorsHeaderError(f"tensor {name!r} has a malformed shape")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
    ):
        raise SafetensorsHeaderError(f"tensor {name!r} has malformed data offsets")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise SafetensorsHeaderError(f"tensor {name!r}: its offsets do not match its shape and dtype")
    return begin, end, name
