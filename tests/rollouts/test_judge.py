"""The judge's verdicts on synthetic windows: pure, no database."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace

import pytest

from rollouts.judge import (
    FISHER_TEST,
    Z_TEST,
    Thresholds,
    VerdictKind,
    VersionWindow,
    decide,
    fisher_exact_greater,
    proportion_greater,
    two_proportion_z_greater,
)
from tests.rollouts.conftest import window

DEFAULTS = Thresholds()


def judge(canary: VersionWindow, incumbent: VersionWindow, *, bake_elapsed_s: float = 120.0, **limits):
    return decide(
        canary,
        incumbent,
        thresholds=Thresholds(**limits) if limits else DEFAULTS,
        bake_elapsed_s=bake_elapsed_s,
        bake_seconds=60,
    )


def test_a_healthy_canary_holds_during_the_bake_window_and_advances_after_it() -> None:
    canary, incumbent = window(num_requests=200, num_errors=1), window(num_requests=4000, num_errors=20)
    during = judge(canary, incumbent, bake_elapsed_s=30)
    after = judge(canary, incumbent, bake_elapsed_s=60)
    assert during.kind is VerdictKind.HOLD
    assert "baked 30 of 60 s" in during.reason
    assert after.kind is VerdictKind.ADVANCE
    assert after.figures["canary"]["num_requests"] == 200
    assert after.figures["incumbent"]["error_rate"] == 0.005
    assert after.figures["errors_test"]["p_value"] > 0.01


def test_a_canary_with_2_5x_the_p99_tpot_is_rolled_back_at_once_with_the_figures() -> None:
    verdict = judge(window(tpot_p99_ms=50.0), window(tpot_p99_ms=20.0), bake_elapsed_s=1, tpot_sla_ms=30)
    assert verdict.kind is VerdictKind.ROLLBACK  # before the bake window ends
    assert "p99 TPOT 50.0 ms > limit 30.0 ms" in verdict.reason
    assert verdict.figures["canary"]["tpot_p99_ms"] == 50.0
    assert verdict.figures["incumbent"]["tpot_p99_ms"] == 20.0
    assert verdict.figures["tpot_limit_ms"] == 30.0  # max(SLA 30, 20 x 1.25)


def test_latency_limit_is_the_larger_of_the_sla_and_the_incumbent_times_the_ratio() -> None:
    # 2x slower than the incumbent, but inside the SLA: not a regression.
    inside_sla = judge(window(ttft_p99_ms=240.0), window(ttft_p99_ms=120.0), ttft_sla_ms=500)
    assert inside_sla.kind is VerdictKind.ADVANCE
    assert inside_sla.figures["ttft_limit_ms"] == 500.0
    # Over the SLA but within 1.25x of an incumbent that is itself over it: not a regression either.
    near_incumbent = judge(window(ttft_p99_ms=740.0), window(ttft_p99_ms=600.0), ttft_sla_ms=500)
    assert near_incumbent.kind is VerdictKind.ADVANCE
    over_both = judge(window(ttft_p99_ms=760.0), window(ttft_p99_ms=600.0), ttft_sla_ms=500)
    assert over_both.kind is VerdictKind.ROLLBACK
    assert "TTFT" in over_both.reason


def test_figures_are_valid_json_even_when_a_limit_overflows() -> None:
    """A deployment saved before thresholds had upper bounds may hold latency_ratio=1e308: its limit is
    inf, and a figure of inf made every tick's save fail (JSON has no infinity), freezing the rollout."""
    verdict = judge(window(ttft_p99_ms=240.0), window(ttft_p99_ms=120.0), latency_ratio=1e308)
    assert verdict.kind is VerdictKind.ADVANCE
    assert verdict.figures["ttft_limit_ms"] is None
    json.dumps(verdict.figures, allow_nan=False)


def test_an_erroring_canary_is_rolled_back_by_the_z_test() -> None:
    canary = window(num_requests=10000, num_errors=500)  # 5%
    incumbent = window(num_requests=80000, num_errors=800)  # 1%
    verdict = judge(canary, incumbent, bake_elapsed_s=5)
    assert verdict.kind is VerdictKind.ROLLBACK
    test = verdict.figures["errors_test"]
    assert test["test"] == Z_TEST
    assert test["statistic"] > 5
    assert test["p_value"] < 1e-6
    assert "error rate 5.00% vs incumbent 1.00%" in verdict.reason


def test_few_errors_against_a_clean_incumbent_use_fishers_exact_test() -> None:
    canary = window(num_requests=60, num_errors=4)
    incumbent = window(num_requests=3000, num_errors=2)
    verdict = judge(canary, incumbent)
    assert verdict.figures["errors_test"]["test"] == FISHER_TEST
    assert verdict.kind is VerdictKind.ROLLBACK
    # One error in 60 against 2 in 3000 is not significant at 0.01: no rollback on a single failure.
    one = judge(window(num_requests=60, num_errors=1), incumbent)
    assert one.figures["errors_test"]["test"] == FISHER_TEST
    assert one.kind is VerdictKind.ADVANCE


def test_significant_but_negligible_error_increases_are_not_rollbacks() -> None:
    canary = window(num_requests=200_000, num_errors=2_300)  # 1.15%
    incumbent = window(num_requests=2_000_000, num_errors=20_000)  # 1.00%
    verdict = judge(canary, incumbent, min_rate_increase=0.005)
    assert verdict.figures["errors_test"]["p_value"] < 0.01
    assert verdict.kind is VerdictKind.ADVANCE
    assert judge(canary, incumbent, min_rate_increase=0.0).kind is VerdictKind.ROLLBACK


def test_too_few_samples_gives_no_verdict_however_bad_the_canary_looks() -> None:
    awful = window(num_requests=49, num_errors=49, ttft_p99_ms=10_000.0, tpot_p99_ms=5_000.0)
    verdict = judge(awful, window(num_requests=5000))
    assert verdict.kind is VerdictKind.INSUFFICIENT_DATA
    assert "canary has 49 of 50 requests" in verdict.reason
    starved_incumbent = judge(window(), window(num_requests=10), min_samples=20)
    assert starved_incumbent.kind is VerdictKind.INSUFFICIENT_DATA
    assert "incumbent has 10 of 20" in starved_incumbent.reason


def test_the_quality_proxy_rolls_back_empty_or_short_outputs() -> None:
    empty = judge(
        window(num_requests=300, num_empty_outputs=30), window(num_requests=6000, num_empty_outputs=6)
    )
    assert empty.kind is VerdictKind.ROLLBACK
    assert "empty-output rate" in empty.reason
    short = judge(window(mean_output_tokens=20.0), window(mean_output_tokens=60.0))
    assert short.kind is VerdictKind.ROLLBACK
    assert "mean output 20.0 tokens < 30.0" in short.reason
    # Untested, so not at every look: a few dozen heavy-tailed lengths fall short now and then.
    early = judge(window(mean_output_tokens=20.0), window(mean_output_tokens=60.0), bake_elapsed_s=30)
    assert early.kind is VerdictKind.HOLD


def test_the_quality_proxy_rolls_back_a_canary_that_runs_into_max_tokens_far_more_often() -> None:
    # A canary that stopped ending its answers: 70% hit their max_tokens, against the incumbent's 30%.
    unending = judge(
        window(num_requests=300, num_errors=0, num_truncated=210),
        window(num_requests=6000, num_errors=0, num_truncated=1800),
    )
    assert unending.kind is VerdictKind.ROLLBACK
    assert "truncated-output rate 70.00% vs incumbent 30.00%" in unending.reason
    assert unending.figures["canary"]["truncated_output_rate"] == 0.7
    # 32% against 30% over big windows is significant, but under the 5-point minimum: clients' max_tokens
    slightly = judge(
        window(num_requests=20_000, num_errors=0, num_truncated=6400),
        window(num_requests=80_000, num_errors=0, num_truncated=24_000),
    )
    assert slightly.figures["truncated_test"]["p_value"] < slightly.figures["truncated_test"]["alpha"]
    assert slightly.kind is VerdictKind.ADVANCE


def test_unknown_thresholds_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown threshold"):
        Thresholds.from_dict({"p999_ms": 3})


def test_fisher_and_z_match_reference_values() -> None:
    # Fisher's tea-tasting table [[3, 1], [1, 3]], one-sided: 17/70.
    assert fisher_exact_greater(3, 4, 1, 4) == pytest.approx(17 / 70)
    assert fisher_exact_greater(0, 10, 5, 10) == pytest.approx(1.0)
    z, p = two_proportion_z_greater(30, 200, 20, 200)
    assert z == pytest.approx(1.5119, abs=1e-4)
    assert p == pytest.approx(0.06528, abs=1e-4)
    assert proportion_greater(0, 100, 0, 1000).p_value == 1.0


def test_few_expected_events_are_tested_exactly_not_by_the_normal_tail() -> None:
    """At the judge's alphas the z-test's tail is far off with few events: 18 of 900 against 100 of
    20,000 (5.1 expected) reads 2e-9 by it, 3e-6 exactly: a rollback at a bar of 1e-6 it does not earn."""
    z_p = two_proportion_z_greater(18, 900, 100, 20000)[1]
    exact = proportion_greater(18, 900, 100, 20000)
    assert exact.name == FISHER_TEST
    assert exact.p_value == pytest.approx(fisher_exact_greater(18, 900, 100, 20000))
    assert z_p < 1e-8 < 1e-6 < exact.p_value
    assert proportion_greater(500, 10000, 800, 80000).name == Z_TEST  # 144 expected: the z-test holds


@dataclass
class Tail:
    """Latency samples in ms, answering what the judge asks of a distribution."""

    samples: list[float]

    @property
    def count(self) -> int:
        return len(self.samples)

    def count_above(self, value_ms: float) -> int:
        return sum(1 for v in self.samples if v > value_ms)


def test_one_slow_request_in_a_small_canary_window_is_not_a_latency_regression() -> None:
    """With 60 samples the p99 is the slowest request: one slow one moves it over the limit. The
    incumbent has its own slow requests over the same limit; 1 of 60 against 40 of 3000 is no evidence."""
    incumbent_samples = [16.0] * 2940 + [19.0] * 20 + [30.0] * 40  # p99 19 ms, limit 23.75 ms
    incumbent = window(num_requests=3000, tpot_p99_ms=19.0, tpot_tail=Tail(incumbent_samples))
    canary = window(num_requests=60, num_errors=0, tpot_p99_ms=60.0, tpot_tail=Tail([16.0] * 59 + [60.0]))
    verdict = judge(canary, incumbent, tpot_sla_ms=10)
    assert verdict.kind is VerdictKind.HOLD  # past the bake window: held until more samples settle it
    assert "not significant yet (1 of 60 canary requests over it vs 40 of 3000" in verdict.reason
    test = verdict.figures["tpot_test"]
    assert test["test"] == FISHER_TEST
    assert (test["canary_over_limit"], test["incumbent_over_limit"]) == (1, 40)
    # Once the p99 is back within the limit, it advances; the point rule alone would have rolled it back.
    settled = replace(canary, num_requests=120, tpot_p99_ms=16.0, tpot_tail=Tail([16.0] * 119 + [60.0]))
    assert judge(settled, incumbent, tpot_sla_ms=10).kind is VerdictKind.ADVANCE
    point_only = judge(replace(canary, tpot_tail=None), incumbent, tpot_sla_ms=10)
    assert point_only.kind is VerdictKind.ROLLBACK
    # A tenth of the canary's requests over the limit is a regression, with its figures.
    slow = window(num_requests=60, num_errors=0, tpot_p99_ms=45.0, tpot_tail=Tail([16.0] * 54 + [45.0] * 6))
    rolled = judge(slow, incumbent, tpot_sla_ms=10)
    assert rolled.kind is VerdictKind.ROLLBACK
    assert "6 of 60 canary requests over it vs 40 of 3000" in rolled.reason
    assert rolled.figures["tpot_test"]["p_value"] < 1e-3


# --- noisy but fine, and slow, over seeded random traffic -------------------------------------------


def _p99(samples: list[float]) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]  # nearest rank


@dataclass
class Requests:
    """Per-request outcomes of one version, as a replica would record them."""

    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    num_errors: int = 0
    num_truncated: int = 0

    def add(
        self,
        rng: random.Random,
        *,
        tpot_scale: float = 1.0,
        error_rate: float = 0.01,
        stall_rate: float = 0.0,
    ) -> None:
        if rng.random() < error_rate:
            self.num_errors += 1
            return
        # Latency of a busy replica: lognormal jitter with a heavy-ish tail; a `stall_rate` share of
        # requests also shares its CPU with something else for a while (1.5-3x slower), as replicas on
        # this 2-core machine do.
        stall = rng.uniform(1.5, 3.0) if rng.random() < stall_rate else 1.0
        self.ttft_ms.append(80.0 * stall * rng.lognormvariate(0.0, 0.35))
        self.tpot_ms.append(20.0 * tpot_scale * stall * rng.lognormvariate(0.0, 0.2))
        self.output_tokens.append(0 if rng.random() < 0.005 else rng.randint(20, 100))
        self.num_truncated += rng.random() < 0.3  # clients' max_tokens cut a third of the answers short

    def window(self, *, with_tails: bool = True) -> VersionWindow:
        ok = len(self.output_tokens)
        return VersionWindow(
            num_requests=ok + self.num_errors,
            num_errors=self.num_errors,
            num_empty_outputs=sum(1 for n in self.output_tokens if n == 0),
            num_truncated=self.num_truncated,
            ttft_p99_ms=_p99(self.ttft_ms),
            tpot_p99_ms=_p99(self.tpot_ms),
            mean_output_tokens=sum(self.output_tokens) / ok if ok else None,
            ttft_tail=Tail(self.ttft_ms) if with_tails else None,
            tpot_tail=Tail(self.tpot_ms) if with_tails else None,
        )


def simulate_rollout(
    seed: int,
    *,
    steps: tuple[int, ...] = (5, 25, 50, 100),
    requests_per_s: float = 40.0,
    tick_s: float = 5.0,
    bake_s: float = 30.0,
    canary_tpot_scale: float = 1.0,
    canary_error_rate: float = 0.01,
    stall_rate: float = 0.0,
    with_tails: bool = True,
    thresholds: Thresholds = DEFAULTS,
) -> tuple[str, float, list[VerdictKind]]:
    """A whole canary rollout, one judge tick every `tick_s`, each over [step start, now) as the service
    reads it, with the service's count of looks per bake window. Returns how it ended, when, and every
    verdict."""
    rng = random.Random(seed)
    num_looks = math.ceil(bake_s / tick_s) + 1
    verdicts: list[VerdictKind] = []
    clock = 0.0
    for pct in steps:
        if pct == 100:
            return "promoted", clock, verdicts
        canary, incumbent = Requests(), Requests()
        step_start = clock
        look = 0
        while True:
            look += 1
            for _ in range(round(requests_per_s * tick_s)):
                if rng.random() < pct / 100:
                    canary.add(
                        rng,
                        tpot_scale=canary_tpot_scale,
                        error_rate=canary_error_rate,
                        stall_rate=stall_rate,
                    )
                else:
                    incumbent.add(rng, stall_rate=stall_rate)
            clock += tick_s
            verdict = decide(
                canary.window(with_tails=with_tails),
                incumbent.window(with_tails=with_tails),
                thresholds=thresholds,
                bake_elapsed_s=clock - step_start,
                bake_seconds=bake_s,
                num_looks=num_looks,
                look=look,
            )
            verdicts.append(verdict.kind)
            if verdict.kind is VerdictKind.ROLLBACK:
                return "rolled_back", clock, verdicts
            if verdict.kind is VerdictKind.ADVANCE:
                break
    return "promoted", clock, verdicts


def test_noisy_but_fine_canary_windows_are_never_rolled_back_in_20_seeds() -> None:
    """Same distribution for both versions, 200 canary vs 3800 incumbent requests per window."""
    kinds = []
    for seed in range(20):
        rng = random.Random(seed)
        canary, incumbent = Requests(), Requests()
        for _ in range(4000):
            (canary if rng.random() < 0.05 else incumbent).add(rng)
        kinds.append(judge(canary.window(), incumbent.window()).kind)
    assert kinds == [VerdictKind.ADVANCE] * 20


def test_a_healthy_canary_is_promoted_in_20_seeded_rollouts_with_every_tick_judged() -> None:
    outcomes = [simulate_rollout(seed) for seed in range(20)]
    assert [o[0] for o in outcomes] == ["promoted"] * 20
    assert all(VerdictKind.ROLLBACK not in verdicts for _, _, verdicts in outcomes)


def test_a_2_5x_tpot_canary_at_5pct_is_rolled_back_within_one_bake_window_plus_one_tick() -> None:
    thresholds = Thresholds(tpot_sla_ms=30.0)
    for seed in range(20):
        outcome, at_s, verdicts = simulate_rollout(seed, canary_tpot_scale=2.5, thresholds=thresholds)
        assert outcome == "rolled_back"
        assert at_s <= 30.0 + 5.0
        assert VerdictKind.ADVANCE not in verdicts


# The SLA floor at (or under) the incumbent's own p99, so the limit is the incumbent's p99 x 1.25: what
# the real-replica runs in docs/benchmarks.md used, and where tails decide.
TIGHT = Thresholds(ttft_sla_ms=1.0, tpot_sla_ms=1.0)


def test_healthy_canaries_with_stalls_on_both_versions_are_promoted_in_20_seeds() -> None:
    outcomes = [simulate_rollout(seed, stall_rate=0.03, thresholds=TIGHT) for seed in range(20)]
    assert [o[0] for o in outcomes] == ["promoted"] * 20


def test_without_the_exceedance_test_the_same_healthy_canaries_are_rolled_back() -> None:
    """The point rule alone (canary p99 > limit) on the runs above: this is what the test prevents."""
    outcomes = [
        simulate_rollout(seed, stall_rate=0.03, thresholds=TIGHT, with_tails=False) for seed in range(20)
    ]
    assert sum(o[0] == "rolled_back" for o in outcomes) >= 5


def test_a_2_5x_tpot_canary_with_stalls_is_rolled_back_without_ever_advancing() -> None:
    """Stalls put both p99s in the stall tail, so only ~5% of the slow canary's requests cross the
    limit: with ~50 samples that can take a few more looks to be significant, and the judge holds, never
    advancing, until it is."""
    times = []
    for seed in range(20):
        outcome, at_s, verdicts = simulate_rollout(
            seed, canary_tpot_scale=2.5, stall_rate=0.03, thresholds=TIGHT
        )
        assert outcome == "rolled_back"
        assert VerdictKind.ADVANCE not in verdicts
        times.append(at_s)
    assert sorted(times)[len(times) // 2] <= 30.0 + 5.0  # the median still within one bake + one tick


def test_a_canary_failing_10pct_of_requests_is_rolled_back_before_it_reaches_50pct() -> None:
    # 5% traffic at 40 requests/s gives the canary ~60 requests per 30 s step: enough to see 10% vs 1%
    # at the per-look alpha most of the time in the first step, always by the end of the second.
    outcomes = [simulate_rollout(seed, canary_error_rate=0.10) for seed in range(20)]
    assert [o[0] for o in outcomes] == ["rolled_back"] * 20
    assert max(at_s for _, at_s, _ in outcomes) <= 2 * (30.0 + 5.0)


def test_looks_past_the_bake_window_spend_another_alpha_slowly() -> None:
    canary = window(num_requests=300, num_errors=10)  # Fisher p = 0.0016 against 1%
    incumbent = window(num_requests=6000, num_errors=60)

    def alpha_at(look: int) -> float:
        verdict = decide(
            canary,
            incumbent,
            thresholds=DEFAULTS,
            bake_elapsed_s=120,
            bake_seconds=60,
            num_looks=7,
            look=look,
        )
        return verdict.figures["errors_test"]["alpha"]

    assert alpha_at(7) == pytest.approx(0.01 / 35, rel=1e-3)  # the last planned look: 5 tests x 7 looks
    # then 6 / (pi^2 j^2) of alpha over the 5 tests at the j-th look past the plan: at most alpha more
    assert alpha_at(8) == pytest.approx(0.01 * 6 / math.pi**2 / 5, rel=1e-3)
    assert alpha_at(9) == pytest.approx(alpha_at(8) / 4, rel=1e-3)
    assert sum(0.01 * 6 / (math.pi**2 * j**2) for j in range(1, 10**5)) <= 0.01 + 1e-12


def test_repeated_looks_divide_alpha_bonferroni_style() -> None:
    canary = window(num_requests=300, num_errors=10)  # 3.3% vs 1%: Fisher p = 0.0016
    incumbent = window(num_requests=6000, num_errors=60)
    single = judge(canary, incumbent)
    assert single.kind is VerdictKind.ROLLBACK
    many = decide(canary, incumbent, thresholds=DEFAULTS, bake_elapsed_s=120, bake_seconds=60, num_looks=13)
    assert many.figures["errors_test"]["alpha"] == pytest.approx(0.01 / 65, rel=1e-3)  # 5 tests x 13 looks
    assert many.kind is VerdictKind.ADVANCE


def test_a_canary_held_past_its_bake_window_is_rolled_back_once_its_evidence_grows() -> None:
    """Looks past the plan test at a bar that rises slowly: a p-value of 3e-6 (2% of requests over the
    TPOT limit against 0.5%) rolls it back at the tenth extra look, where halving alpha each look had
    raised the bar to 2e-6 and held it (and further every look after)."""
    incumbent = window(num_requests=20000, tpot_p99_ms=19.0, tpot_tail=Tail([16.0] * 19900 + [30.0] * 100))
    canary = window(num_requests=900, tpot_p99_ms=30.0, tpot_tail=Tail([16.0] * 882 + [30.0] * 18))
    verdict = decide(
        canary,
        incumbent,
        thresholds=Thresholds(tpot_sla_ms=10),
        bake_elapsed_s=600,
        bake_seconds=60,
        num_looks=12,
        look=22,
    )
    test = verdict.figures["tpot_test"]
    assert 0.01 / (5 * 2**10) < test["p_value"] < test["alpha"]
    assert verdict.kind is VerdictKind.ROLLBACK
