"""A mergeable histogram with fixed log-spaced buckets: percentiles over any set of replicas and
windows come from adding bucket counts, never from averaging percentiles.

Bucket i >= 1 holds values in (MIN_VALUE * GROWTH**(i-1), MIN_VALUE * GROWTH**i]; bucket 0 holds
everything <= MIN_VALUE (zero included). A bucket is reported by the harmonic mean of its bounds, which
is within (GROWTH - 1) / (GROWTH + 1) = 0.990% of every value in it, so `quantile(q)` is within 1% of
the exact nearest-rank quantile of the raw samples for values from 1 ms to 100 s (and on up to
MAX_VALUE, which also covers batch sizes and token counts). The exact min and max are kept as well and
bound every answer. Bucket positions never change, so histograms from any process merge by addition,
and only non-empty buckets are stored.

Pure Python, no Django: the replica's model thread records into these, the store keeps their JSON."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

MIN_VALUE = 1e-3
MAX_VALUE = 1e6
GROWTH = 1.02
MAX_RELATIVE_ERROR = (GROWTH - 1) / (GROWTH + 1)
_LOG_GROWTH = math.log(GROWTH)
MAX_INDEX = math.ceil(math.log(MAX_VALUE / MIN_VALUE) / _LOG_GROWTH)
FORMAT_VERSION = 1


class HistogramFormatError(ValueError):
    """A stored histogram that cannot be read back (wrong layout or version, inconsistent counts)."""


def bucket_index(value: float) -> int:
    if not value > MIN_VALUE:  # also catches NaN, which lands in the lowest bucket rather than raising
        return 0
    # The float log can put a value that sits exactly on a bound one bucket up; the representative of
    # either neighbour is still within MAX_RELATIVE_ERROR of that bound.
    return min(MAX_INDEX, math.ceil(math.log(value / MIN_VALUE) / _LOG_GROWTH))


def bucket_upper_bound(index: int) -> float:
    return MIN_VALUE * GROWTH**index


def bucket_value(index: int) -> float:
    """The value reported for a bucket: the harmonic mean of its bounds (equal relative error at both)."""
    if index == 0:
        return MIN_VALUE
    lower, upper = bucket_upper_bound(index - 1), bucket_upper_bound(index)
    return 2 * lower * upper / (lower + upper)


def nearest_rank(q: float, count: int) -> int:
    """The 1-based rank of the q-quantile among `count` sorted samples (nearest-rank definition)."""
    return min(count, max(1, math.ceil(q * count - 1e-9)))


class Histogram:
    __slots__ = ("_counts", "count", "max", "min", "sum")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    @classmethod
    def of(cls, values: Iterable[float]) -> Histogram:
        histogram = cls()
        for value in values:
            histogram.observe(value)
        return histogram

    @classmethod
    def merged(cls, histograms: Iterable[Histogram]) -> Histogram:
        result = cls()
        for histogram in histograms:
            result.merge(histogram)
        return result

    def observe(self, value: float, count: int = 1) -> None:
        if count <= 0:
            return
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a histogram observes finite values >= 0, got {value!r}")
        index = bucket_index(value)
        self._counts[index] = self._counts.get(index, 0) + count
        self.count += count
        self.sum += value * count
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value

    def merge(self, other: Histogram) -> Histogram:
        """Add `other`'s samples to this histogram (in place); returns self."""
        if other.count == 0:
            return self
        counts = self._counts
        for index, n in other._counts.items():
            counts[index] = counts.get(index, 0) + n
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        return self

    def copy(self) -> Histogram:
        return Histogram().merge(self)

    def __add__(self, other: Histogram) -> Histogram:
        return self.copy().merge(other)

    @property
    def is_empty(self) -> bool:
        return self.count == 0

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    @property
    def num_buckets(self) -> int:
        return len(self._counts)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 <= q <= 1) within 1% of the exact nearest-rank one; None with no samples."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q!r}")
        if self.count == 0:
            return None
        rank = nearest_rank(q, self.count)
        seen = 0
        for index in sorted(self._counts):
            seen += self._counts[index]
            if seen >= rank:
                return min(self.max, max(self.min, bucket_value(index)))
        raise AssertionError("bucket counts add up to count")

    def cumulative_counts(self, bounds: Sequence[float], *, monotonic: bool = False) -> list[int]:
        """For each upper bound (ascending), how many samples are <= it, as well as buckets can tell
        (a bucket counts when its reported value, clamped to [min, max] as quantile() clamps it, is
        <= the bound). For the judge's count of samples over a limit and the dashboard's bins.

        `monotonic` (Prometheus `le` buckets, counters that must never go down): clamped to the min
        only. A later, larger sample raises the max, which would lift a bucket reported just under a
        bound over it, and the bound's count would fall; the min only ever falls, which can only move
        a bucket under a bound."""
        result: list[int] = []
        items = sorted(self._counts.items())
        high = math.inf if monotonic else self.max
        position = seen = 0
        for bound in bounds:
            while (
                position < len(items) and min(high, max(self.min, bucket_value(items[position][0]))) <= bound
            ):
                seen += items[position][1]
                position += 1
            result.append(seen)
        return result

    def count_above(self, value: float) -> int:
        """How many samples are > value, as well as buckets can tell (the complement of
        cumulative_counts([value]))."""
        return self.count - self.cumulative_counts([value])[0]

    # --- storage -------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Sparse: bucket indices ascending and their counts, plus count, sum, min and max."""
        indices = sorted(self._counts)
        return {
            "v": FORMAT_VERSION,
            "n": self.count,
            "s": self.sum,
            "lo": self.min if self.count else None,
            "hi": self.max if self.count else None,
            "i": indices,
            "c": [self._counts[i] for i in indices],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Histogram:
        try:
            if data.get("v") != FORMAT_VERSION:
                raise HistogramFormatError(f"unknown histogram format {data.get('v')!r}")
            indices, counts = data["i"], data["c"]
            histogram = cls()
            if len(indices) != len(counts):
                raise HistogramFormatError("bucket indices and counts differ in length")
            for index, n in zip(indices, counts, strict=True):
                if not (isinstance(index, int) and 0 <= index <= MAX_INDEX and isinstance(n, int) and n > 0):
                    raise HistogramFormatError(f"bad bucket {index!r}: {n!r}")
                histogram._counts[index] = histogram._counts.get(index, 0) + n
            histogram.count = int(data["n"])
            if histogram.count != sum(histogram._counts.values()):
                raise HistogramFormatError("count differs from the sum of bucket counts")
            histogram.sum = float(data["s"])
            if histogram.count:
                histogram.min, histogram.max = float(data["lo"]), float(data["hi"])
        except (KeyError, TypeError) as exc:
            raise HistogramFormatError(f"malformed histogram: {exc}") from exc
        return histogram

    def __eq__(self, other: object) -> bool:
        """Same samples as far as buckets tell (sums compared with a float tolerance: addition order)."""
        if not isinstance(other, Histogram):
            return NotImplemented
        return (
            self._counts == other._counts
            and self.count == other.count
            and (self.count == 0 or (self.min == other.min and self.max == other.max))
            and math.isclose(self.sum, other.sum, rel_tol=1e-9, abs_tol=1e-12)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        if not self.count:
            return "Histogram(empty)"
        return (
            f"Histogram(count={self.count}, p50={self.quantile(0.5):.6g}, p99={self.quantile(0.99):.6g}, "
            f"max={self.max:.6g})"
        )
