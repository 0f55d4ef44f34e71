"""How a non-generative model's result crosses the channel layer: each row of vectors (embeddings, a
classifier's scores) as little-endian float32 in base64. The replica encodes, the gateway decodes."""

from __future__ import annotations

import array
import base64
import sys
from typing import Any


def encode_vectors(vectors: Any) -> list[str]:
    """Each row of a float tensor as little-endian float32 in base64: a quarter of the JSON floats' size
    on the channel layer, and what the OpenAI API's encoding_format "base64" returns as it is."""
    rows = vectors.numpy().astype("<f4", copy=False)
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]


def decode_vector(encoded: str) -> list[float]:
    """One row that encode_vectors wrote, as Python floats."""
    vector = array.array("f", base64.b64decode(encoded))
    if sys.byteorder != "little":
        vector.byteswap()
    return vector.tolist()
