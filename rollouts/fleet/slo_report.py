"""SLO-aware admission at overload as text: what `manage.py simulate slo` prints (docs/benchmarks.md,
"SLO-aware admission in the simulator")."""

from __future__ import annotations

from rollouts.fleet.slo_experiment import WITHIN, Outcome, SloComparison

TARGET_MET_SHARE = 0.95  # of admitted requests within the objective, with admission (issue 37)


def _span(span: tuple[int, int]) -> str:
    low, high = span
    return f"{low}" if low == high else f"{low}-{high}"


def _row(name: str, outcome: Outcome) -> str:
    admitted = f"{outcome.admitted} ({outcome.admitted / outcome.arrived:.1%})" if outcome.arrived else "0"
    met = f"{outcome.met} ({outcome.met_share:.1%})"
    return (
        f"  {name:<18} {admitted:>14}  {met:>16}  {outcome.p50_ttft_s * 1000:8.0f}  "
        f"{outcome.p99_ttft_s * 1000:8.0f}  {outcome.goodput_rps:8.1f}"
    )


def slo_lines(result: SloComparison) -> list[str]:
    s, cap, ra = result.settings, result.capacity, result.retry_after
    objective_ms = f"{s.objective_s * 1000:g} ms"
    if cap.measured:
        how = (
            f"measured: the highest Poisson rate at which these replicas, without admission, kept p99 TTFT "
            f"within {objective_ms} over the same {s.duration_s:g} s (p99 {cap.p99_ttft_s * 1000:.0f} ms "
            f"there; {cap.probes} runs, to within 2%)"
        )
    else:
        how = "given (--capacity)"
    without, with_ = result.without, result.with_admission
    lines = [
        f"SLO-aware admission at {s.overload:g}x capacity: {s.replicas} static replicas, TTFT objective "
        f"{objective_ms}, {s.duration_s:g} s of Poisson arrivals, prompts {_span(s.prompt_tokens)} and "
        f"outputs {_span(s.output_tokens)} tokens, seed {s.seed}",
        f"Capacity:  {cap.rps:.1f} req/s, {how}",
        f"Offered:   {result.rate_rps:.1f} req/s ({s.overload:g} x {cap.rps:.1f}): {without.arrived} "
        "requests, the same arrivals in both runs",
        f"  {'':<18} {'admitted':>14}  {'within objective':>16}  {'TTFT p50':>8}  {'TTFT p99':>8}  "
        f"{'goodput':>8}",
        _row("without admission", without),
        _row("with admission", with_),
        "  (within objective: of the admitted; TTFT in ms, over the admitted; goodput: requests a second "
        "whose first token came within the objective)",
    ]
    ratio = with_.goodput_rps / without.goodput_rps if without.goodput_rps else float("inf")
    lines.append(
        f"Goodput within the objective: {with_.goodput_rps:.1f} req/s with admission, "
        f"{without.goodput_rps:.1f} without ({ratio:.2f}x); admitted within it: {with_.met_share:.1%} "
        f"(target {TARGET_MET_SHARE:.0%})"
    )
    if with_.met_share < TARGET_MET_SHARE:
        lines.append(
            "  Under the target: the forecast counts the prompt tokens queued ahead and the wait for a seat "
            "in a full batch, not the wait for KV blocks (--num-blocks) nor preemptions "
            '(docs/architecture.md, "SLO-aware admission"), so where those hold requests back it is '
            "optimistic and admits what then misses."
        )
    lines.append(
        f"Retry-After: {ra.refusals} refusals, {ra.observed} with the wait they avoided observed (from the "
        "refusal until the gateway, forecasting the same request again after each replica step, would "
        f"first have admitted it): median {ra.median_avoided_s * 1000:.0f} ms against a forecast wait of "
        f"{ra.median_retry_after_s * 1000:.0f} ms"
    )
    lines.append(
        f"  forecast wait within ±{WITHIN:.0%} of the wait avoided: {ra.within:.1%}, median ratio "
        f"{ra.median_ratio:.2f}; the header's whole seconds (at least 1): {ra.header_within:.1%}, median "
        f"ratio {ra.header_median_ratio:.1f}; retry-after-ms: {ra.ms_header_within:.1%}, median ratio "
        f"{ra.ms_header_median_ratio:.2f}"
    )
    lines.append(f"Simulated in {result.wall_s:.1f} s of real time, the capacity's runs included.")
    return lines
