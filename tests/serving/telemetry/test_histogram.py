"""The mergeable histogram: percentiles of merged buckets against the exact percentiles of raw samples."""

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.telemetry.histogram import MAX_RELATIVE_ERROR, Histogram, HistogramFormatError, bucket_index

QUANTILES = (0.0, 0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)

latencies = st.floats(min_value=1e-3, max_value=100.0, allow_nan=False, allow_infinity=False)
sample_lists = st.lists(latencies, min_size=1, max_size=400)


def exact_quantile(samples: list[float], q: float) -> float:
    """Nearest rank: the smallest sample with at least q of all samples at or below it."""
    ordered = sorted(samples)
    rank = min(len(ordered), max(1, math.ceil(q * len(ordered) - 1e-9)))
    return ordered[rank - 1]


def relative_error(estimate: float, exact: float) -> float:
    return abs(estimate - exact) / exact


def test_the_layout_promises_under_one_percent() -> None:
    assert MAX_RELATIVE_ERROR < 0.01


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(sample_lists, min_size=1, max_size=5))
def test_quantiles_of_merged_histograms_are_within_one_percent_of_the_raw_samples(
    parts: list[list[float]],
) -> None:
    merged = Histogram.merged(Histogram.of(part) for part in parts)
    samples = [value for part in parts for value in part]
    assert merged.count == len(samples)
    assert merged.sum == pytest.approx(math.fsum(samples))
    for q in QUANTILES:
        estimate = merged.quantile(q)
        assert estimate is not None
        assert relative_error(estimate, exact_quantile(samples, q)) <= 0.01, q


def test_worst_case_relative_error_over_a_dense_sweep_from_1ms_to_100s() -> None:
    """Values on a fine log grid, each the median of a histogram whose max is far above it (so the exact
    max does not help): the answer is its bucket's value, at most 0.99% off."""
    worst = 0.0
    for i in range(50_001):
        value = 1e-3 * 10 ** (5 * i / 50_000)
        estimate = Histogram.of([0.0, value, 1e6]).quantile(0.5)
        worst = max(worst, relative_error(estimate, value))
    assert worst <= MAX_RELATIVE_ERROR + 1e-12
    assert worst > 0.0098  # the bound is tight: the sweep lands next to bucket edges


@settings(max_examples=200, deadline=None)
@given(a=sample_lists, b=sample_lists, c=sample_lists)
def test_merge_is_associative_and_commutative(a: list[float], b: list[float], c: list[float]) -> None:
    ha, hb, hc = Histogram.of(a), Histogram.of(b), Histogram.of(c)
    assert (ha + hb) + hc == ha + (hb + hc)
    assert ha + hb == hb + ha
    assert ha + hb == Histogram.of(a + b)
    assert ha + Histogram() == ha


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(st.floats(min_value=0, max_value=1e7, allow_nan=False), max_size=200))
def test_the_json_form_round_trips_and_is_sparse(samples: list[float]) -> None:
    histogram = Histogram.of(samples)
    data = json.loads(json.dumps(histogram.to_json()))
    assert Histogram.from_json(data) == histogram
    assert len(data["i"]) == histogram.num_buckets <= len(samples)
    for q in (0.5, 0.99):
        assert Histogram.from_json(data).quantile(q) == histogram.quantile(q)


def test_p99_of_merged_is_not_the_average_of_p99s_on_a_skewed_example() -> None:
    rng = random.Random(5)
    busy = [rng.uniform(0.010, 0.020) for _ in range(10_000)]  # a replica with fast, plentiful requests
    slow = [rng.uniform(0.010, 0.020) for _ in range(80)] + [rng.uniform(3.0, 4.0) for _ in range(20)]
    h_busy, h_slow = Histogram.of(busy), Histogram.of(slow)
    exact = exact_quantile(busy + slow, 0.99)
    averaged = (h_busy.quantile(0.99) + h_slow.quantile(0.99)) / 2
    merged = (h_busy + h_slow).quantile(0.99)
    assert relative_error(merged, exact) <= 0.01
    assert relative_error(averaged, exact) > 10  # averaging percentiles is off by more than 10x here
    assert merged < 0.021 < 1.5 < averaged


def test_values_outside_the_range_stay_bounded_by_the_exact_min_and_max() -> None:
    assert Histogram.of([0.0, 0.0]).quantile(0.5) == 0.0
    sub_millisecond = Histogram.of([0.0, 0.0, 0.0002])
    assert sub_millisecond.quantile(0.0) == 0.0002  # one bucket under 1 ms, bounded by the exact max
    assert sub_millisecond.quantile(1.0) == 0.0002
    huge = Histogram.of([5e6, 6e6])
    assert huge.quantile(0.5) == 5e6  # over the top bucket: bounded by the exact min
    assert Histogram().quantile(0.99) is None
    assert Histogram().mean is None


def test_bad_input_is_refused() -> None:
    histogram = Histogram()
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite values"):
            histogram.observe(bad)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        Histogram.of([1.0]).quantile(1.5)
    good = Histogram.of([0.5, 2.0]).to_json()
    for broken in (
        {**good, "v": 99},
        {**good, "n": 3},
        {**good, "c": [1]},
        {**good, "i": [bucket_index(0.5), -4]},
        {k: v for k, v in good.items() if k != "s"},
    ):
        with pytest.raises(HistogramFormatError):
            Histogram.from_json(broken)


def test_cumulative_counts_for_prometheus_buckets() -> None:
    histogram = Histogram.of([0.004, 0.02, 0.02, 0.3, 7.0])
    assert histogram.cumulative_counts([0.001, 0.005, 0.025, 0.5, 10.0, 100.0]) == [0, 1, 3, 4, 5, 5]


def test_a_prometheus_bucket_count_does_not_fall_when_a_larger_sample_comes() -> None:
    """0.00998 sits in the bucket reported as 0.010044: clamped to the max it counts under le=0.01, and
    a later 0.5, raising the max, lifted it over: Prometheus takes a counter that falls for a reset."""
    histogram = Histogram.of([0.00998])
    before = histogram.cumulative_counts([0.01], monotonic=True)
    histogram.observe(0.5)
    assert histogram.cumulative_counts([0.01], monotonic=True)[0] >= before[0]


PROMETHEUS_BOUNDS = [0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=1e-4, max_value=20.0), min_size=1, max_size=40))
def test_prometheus_bucket_counts_only_rise_as_samples_come(samples: list[float]) -> None:
    histogram, last = Histogram(), [0] * len(PROMETHEUS_BOUNDS)
    for sample in samples:
        histogram.observe(sample)
        counts = histogram.cumulative_counts(PROMETHEUS_BOUNDS, monotonic=True)
        assert all(now >= then for now, then in zip(counts, last, strict=True)), (sample, last, counts)
        assert counts == sorted(counts) and counts[-1] <= histogram.count
        last = counts


def test_count_above_agrees_with_the_reported_quantile() -> None:
    """A tight distribution inside one bucket: the p99 is clamped to the samples' min, and a sample
    counts as over a limit exactly when the reported value is."""
    histogram = Histogram.of([0.9984] * 100)
    limit = 0.99443
    assert histogram.quantile(0.99) > limit
    assert histogram.count_above(limit) == 100
    assert histogram.count_above(0.9985) == 0
