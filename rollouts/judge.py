"""The rollout judge's decision: a pure function of two metric windows over the same interval.

No Django, no database, no clock: `decide(canary, incumbent, ...)` takes what the metrics store reported
for each version over [step start, now) and returns a Verdict with every figure behind it, so that it
can be tested on synthetic windows and audited from the figures stored with each DeploymentEvent (the
latency test's counts are among them; the latency distributions themselves are not).

Rules, in order:
1. INSUFFICIENT_DATA while either version has fewer than `min_samples` finished requests.
2. ROLLBACK at once when any regression holds:
   - latency: the canary's p99 TTFT (or p99 TPOT) > max(SLA, incumbent's p99 x `latency_ratio`). The
     SLA is a floor: a canary well inside the SLA is never rolled back for being relatively slower.
     A p99 over the few dozen requests a 1% canary gets is close to the sample maximum, so one slow
     request would do; when the windows carry both latency distributions the breach must also be
     significant: the canary's share of requests over the limit must exceed the incumbent's share over
     the same limit, by the same one-sided two-proportion test as the rates below. (Testing the
     canary alone against a fixed 1% needs ~2x the samples to see a 2.5x slowdown under heavy tails.)
     A breach that is not significant yet is no rollback, but no advance either: the judge HOLDs (past
     the bake window if need be) until the p99 falls within the limit or the breach is significant.
   - errors: the canary's error rate is higher than the incumbent's by a statistically significant
     margin: one-sided test of H0 "p_canary <= p_incumbent". The test is Fisher's exact test
     (hypergeometric upper tail) when the canary's expected count of errors or of successes is below
     100, else the two-proportion z-test with a pooled variance. (The judge tests at alphas of 1e-4 to
     1e-6, far out in the tail, where the normal approximation overstates significance by orders of
     magnitude when few events are expected: 18 of 900 against 100 of 20,000 reads p = 2e-9 by the
     z-test and 3e-6 exactly. Fisher's sum has at most that many events' terms: cheap at these counts.)
     The difference must also be at least `min_rate_increase` (absolute), so that huge windows do not
     turn harmless differences into rollbacks.
   - quality proxy: the empty-output rate and the truncated-output rate (requests that ran into their
     max_tokens, finish_reason "length"; a model that no longer ends its answers does), both among
     requests that did not fail, tested the same way; the truncated rate must also rise by at least
     `min_truncation_increase`, since it is large and moves with the clients' max_tokens, which the
     split gives both versions alike. And the canary's mean output length below the incumbent's x
     `min_output_length_ratio`, judged once the bake window has passed (no test backs it).
   - output agreement (shadow deployments): the mean share of agreeing tokens of the canary's compared
     copies below `min_agreement` (0, the default, turns it off), judged as the mean output length is:
     once the bake window has passed, and only when copies were compared.
   `alpha` is the false-rollback rate allowed per step. The judge looks at a growing window every few
   seconds (`num_looks` per bake window) and runs five tests per look (two latency, three rates), so
   each single test is run at alpha / (5 x num_looks) (Bonferroni); testing every look at alpha would
   roll back roughly one healthy canary in twenty (measured by the simulated rollouts in
   tests/rollouts/test_judge.py). The first look once the bake window has passed may spend what the
   planned looks never taken (ticks short of min_samples) left, and counts as the plan's last. Looks
   past the planned ones (a step held by an unconfirmed latency
   breach) spend a shrinking share each: look num_looks + j runs each test at alpha x 6 / (pi^2 j^2) / 5,
   so a hold of any length adds at most alpha to the step's false-rollback rate (2 x alpha in all), and
   the bar rises slowly enough that a held canary's growing evidence catches up with it.
3. ADVANCE when healthy (no breach at all) and the step's bake window has elapsed.
4. HOLD otherwise.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

FISHER_TEST = "fisher_exact_one_sided"
Z_TEST = "two_proportion_z_one_sided"
MIN_EXPECTED_COUNT_FOR_Z = 100.0
RATE_TESTS = ("errors", "empty_outputs", "truncated")
LATENCY_METRICS = ("ttft", "tpot")
NUM_TESTS = len(RATE_TESTS) + len(LATENCY_METRICS)


class LatencyTail(Protocol):
    """A version's latency samples in ms, as far as the judge needs them: how many there are and how
    many are over a value (the metrics store answers from its histogram buckets)."""

    @property
    def count(self) -> int: ...

    def count_above(self, value_ms: float) -> int: ...


class VerdictKind(enum.StrEnum):
    INSUFFICIENT_DATA = "insufficient_data"
    HOLD = "hold"
    ADVANCE = "advance"
    ROLLBACK = "rollback"


@dataclass(frozen=True, slots=True)
class VersionWindow:
    """One version's requests over an interval, as the metrics store reports them (merged replicas)."""

    num_requests: int  # finished requests, failed ones included
    num_errors: int
    num_empty_outputs: int  # finished without an error and without a single output token
    ttft_p99_ms: float | None  # None when nothing produced a first token
    tpot_p99_ms: float | None
    mean_output_tokens: float | None
    # The distributions behind the p99s; without them the latency rule compares point estimates only.
    ttft_tail: LatencyTail | None = None
    tpot_tail: LatencyTail | None = None
    # Shadow copies whose text could be compared with the incumbent's, and how many matched.
    num_shadow_compared: int = 0
    num_shadow_matched: int = 0
    num_truncated: int = 0  # finished without an error at their max_tokens (finish_reason "length")
    # Of those compared copies, the mean share of token positions that agreed (None: none compared).
    mean_shadow_agreement: float | None = None
    # Their agreement and first divergence as histograms and means, for the deployment's figures (the
    # judge reads only the mean agreement); None without any compared copy.
    shadow_diffs: dict[str, Any] | None = None

    @property
    def num_ok(self) -> int:
        return self.num_requests - self.num_errors

    @property
    def error_rate(self) -> float | None:
        return self.num_errors / self.num_requests if self.num_requests else None

    @property
    def empty_output_rate(self) -> float | None:
        return self.num_empty_outputs / self.num_ok if self.num_ok else None

    @property
    def truncated_output_rate(self) -> float | None:
        return self.num_truncated / self.num_ok if self.num_ok else None


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Per-deployment limits. Defaults come from settings.ROLLOUT_THRESHOLDS; a deployment may override
    any of them by name (unknown names are refused)."""

    min_samples: int = 50
    ttft_sla_ms: float = 1000.0
    tpot_sla_ms: float = 100.0
    latency_ratio: float = 1.25
    alpha: float = 0.01
    min_rate_increase: float = 0.005
    min_output_length_ratio: float = 0.5
    min_truncation_increase: float = 0.05
    min_agreement: float = 0.0  # a shadow candidate's mean share of agreeing tokens; 0: not judged

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Thresholds:
        unknown = set(values) - cls.names()
        if unknown:
            raise ValueError(f"unknown threshold(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ProportionTest:
    """One-sided test that the canary's rate of something bad exceeds the incumbent's."""

    name: str
    statistic: float | None  # z for the z-test; the canary's count for Fisher's test
    p_value: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "test": self.name,
            "statistic": _round(self.statistic),
            "p_value": float(f"{self.p_value:.4g}"),
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    reasons: tuple[str, ...]
    figures: dict[str, Any]

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def _round(value: float | None, digits: int = 4) -> float | None:
    # The figures are saved as JSON, which has no infinity: a tick that tried to save one failed.
    return None if value is None or not math.isfinite(value) else round(value, digits)


def _normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_exact_greater(x1: int, n1: int, x2: int, n2: int) -> float:
    """One-sided Fisher's exact test: P(X >= x1) where X, the canary's share of all x1 + x2 events, is
    hypergeometric given the margins. Exact for any counts; used when the z-test's normal
    approximation is poor."""
    total_events = x1 + x2
    total = n1 + n2
    lo = max(x1, total_events - n2)
    hi = min(n1, total_events)
    if lo > hi:
        return 0.0
    log_denominator = _log_comb(total, total_events)
    p = sum(
        math.exp(_log_comb(n1, k) + _log_comb(n2, total_events - k) - log_denominator)
        for k in range(lo, hi + 1)
    )
    return min(1.0, p)


def two_proportion_z_greater(x1: int, n1: int, x2: int, n2: int) -> tuple[float, float]:
    """One-sided two-proportion z-test with a pooled variance: (z, P(Z >= z))."""
    pooled = (x1 + x2) / (n1 + n2)
    variance = pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2)
    if variance <= 0.0:
        return 0.0, 1.0
    z = (x1 / n1 - x2 / n2) / math.sqrt(variance)
    return z, _normal_sf(z)


def proportion_greater(x1: int, n1: int, x2: int, n2: int) -> ProportionTest:
    """Is x1/n1 (canary) significantly greater than x2/n2 (incumbent)? Picks the test by the counts."""
    if n1 <= 0 or n2 <= 0:
        return ProportionTest(name=Z_TEST, statistic=None, p_value=1.0)
    pooled = (x1 + x2) / (n1 + n2)
    min_expected = min(n1, n2) * min(pooled, 1.0 - pooled)
    if min_expected < MIN_EXPECTED_COUNT_FOR_Z:
        return ProportionTest(
            name=FISHER_TEST, statistic=float(x1), p_value=fisher_exact_greater(x1, n1, x2, n2)
        )
    z, p = two_proportion_z_greater(x1, n1, x2, n2)
    return ProportionTest(name=Z_TEST, statistic=z, p_value=p)


def _window_figures(window: VersionWindow) -> dict[str, Any]:
    return {
        "num_requests": window.num_requests,
        "num_errors": window.num_errors,
        "num_empty_outputs": window.num_empty_outputs,
        "num_truncated": window.num_truncated,
        "error_rate": _round(window.error_rate, 6),
        "empty_output_rate": _round(window.empty_output_rate, 6),
        "truncated_output_rate": _round(window.truncated_output_rate, 6),
        "ttft_p99_ms": _round(window.ttft_p99_ms, 3),
        "tpot_p99_ms": _round(window.tpot_p99_ms, 3),
        "mean_output_tokens": _round(window.mean_output_tokens, 3),
    }


def decide(
    canary: VersionWindow,
    incumbent: VersionWindow,
    *,
    thresholds: Thresholds,
    bake_elapsed_s: float,
    bake_seconds: float,
    num_looks: int = 1,
    look: int | None = None,
) -> Verdict:
    """`num_looks`: looks planned in the step's bake window; `look`: which one this is (1-based; None:
    within the plan), counting only the step's looks that ran the tests (not INSUFFICIENT_DATA ones)."""
    num_looks = max(1, num_looks)
    extra_looks = 0 if look is None else max(0, look - num_looks)
    if extra_looks:
        # Another alpha in all over the looks past the plan, spent as 6 / (pi^2 j^2) of it at the j-th:
        # a bar that rises slowly, so that a held canary's growing evidence catches up with it. (Halving
        # it each look, as before, raised the bar faster than any canary's samples could: a moderately
        # slow one was held at its step for ever, and a canary that began to fail then went unseen.)
        alpha_per_test = thresholds.alpha * 6 / (math.pi**2 * extra_looks**2) / NUM_TESTS
    elif look is not None and bake_elapsed_s >= bake_seconds:
        # The first look once the bake window has passed may spend what the planned looks never taken
        # left unspent: a low-traffic step that reached min_samples only now would otherwise decide on
        # its one look at the rate meant for many, and advance a failing canary more often than not.
        # (The caller then counts it as the plan's last look, so that any look after it is an extra.)
        alpha_per_test = thresholds.alpha * (num_looks - look + 1) / (NUM_TESTS * num_looks)
    else:
        alpha_per_test = thresholds.alpha / (NUM_TESTS * num_looks)
    figures: dict[str, Any] = {
        "canary": _window_figures(canary),
        "incumbent": _window_figures(incumbent),
        "min_samples": thresholds.min_samples,
        "bake_elapsed_s": round(bake_elapsed_s, 3),
        "bake_seconds": bake_seconds,
        "num_looks": num_looks,
        "look": look,
    }
    short = [
        f"{name} has {w.num_requests} of {thresholds.min_samples} requests"
        for name, w in (("canary", canary), ("incumbent", incumbent))
        if w.num_requests < thresholds.min_samples
    ]
    if short:
        return Verdict(VerdictKind.INSUFFICIENT_DATA, tuple(short), figures)

    regressions: list[str] = []
    unconfirmed: list[str] = []  # p99 over the limit, not (yet) significantly
    slas = {"ttft": thresholds.ttft_sla_ms, "tpot": thresholds.tpot_sla_ms}
    for metric in LATENCY_METRICS:
        sla_ms = slas[metric]
        canary_p99 = getattr(canary, f"{metric}_p99_ms")
        incumbent_p99 = getattr(incumbent, f"{metric}_p99_ms")
        limit = max(sla_ms, incumbent_p99 * thresholds.latency_ratio) if incumbent_p99 is not None else sla_ms
        figures[f"{metric}_limit_ms"] = _round(limit, 3)
        if canary_p99 is None or canary_p99 <= limit:
            continue
        breach = (
            f"canary p99 {metric.upper()} {canary_p99:.1f} ms > limit {limit:.1f} ms "
            f"(max of SLA {sla_ms:g} ms, incumbent {_fmt(incumbent_p99)} ms x {thresholds.latency_ratio:g})"
        )
        canary_tail: LatencyTail | None = getattr(canary, f"{metric}_tail")
        incumbent_tail: LatencyTail | None = getattr(incumbent, f"{metric}_tail")
        if not canary_tail or not incumbent_tail or not canary_tail.count or not incumbent_tail.count:
            regressions.append(breach)
            continue
        over, n = canary_tail.count_above(limit), canary_tail.count
        incumbent_over, incumbent_n = incumbent_tail.count_above(limit), incumbent_tail.count
        test = proportion_greater(over, n, incumbent_over, incumbent_n)
        figures[f"{metric}_test"] = {
            **test.as_dict(),
            "canary_over_limit": over,
            "canary_samples": n,
            "incumbent_over_limit": incumbent_over,
            "incumbent_samples": incumbent_n,
            "alpha": float(f"{alpha_per_test:.4g}"),
        }
        counts = f"{over} of {n} canary requests over it vs {incumbent_over} of {incumbent_n}"
        if test.p_value < alpha_per_test:
            regressions.append(f"{breach}: {counts}, {test.name} p={test.p_value:.2g} < {alpha_per_test:.2g}")
        else:
            unconfirmed.append(f"{breach}, not significant yet ({counts}, p={test.p_value:.2g})")

    rate_checks = (
        (
            "errors",
            "error rate",
            (canary.num_errors, canary.num_requests, incumbent.num_errors, incumbent.num_requests),
            thresholds.min_rate_increase,
        ),
        (
            "empty_outputs",
            "empty-output rate",
            (canary.num_empty_outputs, canary.num_ok, incumbent.num_empty_outputs, incumbent.num_ok),
            thresholds.min_rate_increase,
        ),
        (
            "truncated",
            "truncated-output rate",
            (canary.num_truncated, canary.num_ok, incumbent.num_truncated, incumbent.num_ok),
            thresholds.min_truncation_increase,
        ),
    )
    for key, label, (x1, n1, x2, n2), min_increase in rate_checks:
        test = proportion_greater(x1, n1, x2, n2)
        rate1 = x1 / n1 if n1 else 0.0
        rate2 = x2 / n2 if n2 else 0.0
        figures[f"{key}_test"] = {
            **test.as_dict(),
            "alpha": float(f"{alpha_per_test:.4g}"),
            "min_rate_increase": min_increase,
        }
        if test.p_value < alpha_per_test and rate1 - rate2 >= min_increase:
            regressions.append(
                f"canary {label} {rate1:.2%} vs incumbent {rate2:.2%}: {test.name} p={test.p_value:.2g} "
                f"< {alpha_per_test:.2g} (alpha {thresholds.alpha:g} over {NUM_TESTS} tests x "
                f"{num_looks} looks{f', +{extra_looks} past the bake window' if extra_looks else ''})"
            )

    if canary.mean_output_tokens is not None and incumbent.mean_output_tokens:
        floor = incumbent.mean_output_tokens * thresholds.min_output_length_ratio
        figures["min_mean_output_tokens"] = _round(floor, 3)
        # No test backs this rule (the windows keep no distribution of lengths), so it is not run at every
        # look, where a healthy canary's mean over its first few dozen heavy-tailed lengths would fall
        # under half the incumbent's every so often (~2% of looks at a lognormal sigma of 1.5, 50
        # samples): once the bake window has passed, on the most samples the step will have.
        if canary.mean_output_tokens < floor and bake_elapsed_s >= bake_seconds:
            regressions.append(
                f"canary mean output {canary.mean_output_tokens:.1f} tokens < {floor:.1f} "
                f"(incumbent {incumbent.mean_output_tokens:.1f} x {thresholds.min_output_length_ratio:g})"
            )

    agreement = canary.mean_shadow_agreement
    if thresholds.min_agreement > 0 and agreement is not None:
        figures["min_agreement"] = thresholds.min_agreement
        # Like the mean output length, no test backs it: judged on the step's most copies.
        if agreement < thresholds.min_agreement and bake_elapsed_s >= bake_seconds:
            regressions.append(
                f"canary's shadow outputs agree {agreement:.2%} with the incumbent's, under the minimum "
                f"{thresholds.min_agreement:.2%} ({canary.num_shadow_compared} copies compared)"
            )

    if regressions:
        return Verdict(VerdictKind.ROLLBACK, tuple(regressions), figures)
    if unconfirmed:
        # Neither proven slow nor shown fast: more samples settle it one way or the other.
        return Verdict(VerdictKind.HOLD, tuple(unconfirmed), figures)
    if bake_elapsed_s >= bake_seconds:
        return Verdict(
            VerdictKind.ADVANCE, (f"healthy for the whole bake window ({bake_seconds:g} s)",), figures
        )
    return Verdict(
        VerdictKind.HOLD, (f"healthy so far; baked {bake_elapsed_s:.0f} of {bake_seconds:g} s",), figures
    )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
