"""The capacity planner (`manage.py simulate plan`): the closed form against hand arithmetic, its
monotonicity, its errors, and a short simulation."""

from __future__ import annotations

import dataclasses
import math
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.fleet.accelerators import ACCELERATORS, Accelerator, accelerator_named
from rollouts.fleet.capacity_plan import CapacityPlan, Objectives, plan_capacity
from rollouts.fleet.plan_inputs import SCENARIOS, PlanOverrides, resolve
from rollouts.fleet.plan_simulation import SimulationSettings, simulate_plan

PRESET = SCENARIOS["13b-a100"]


def preset_plan(**objectives: float) -> CapacityPlan:
    return plan_capacity(
        PRESET.model,
        PRESET.accelerator,
        PRESET.workload,
        dataclasses.replace(PRESET.objectives, **objectives),
    )


def near(value: float, expected: float, tolerance: float = 0.15) -> bool:
    return abs(value - expected) <= tolerance * expected


def test_the_13b_a100_preset_is_within_15_percent_of_the_arithmetic_by_hand() -> None:
    plan = preset_plan()
    # 40 layers x 5120 hidden x 2 (K, V) x 2 bytes: 0.8 MB a token.
    kv = 40 * 5120 * 2 * 2
    assert plan.memory.kv_per_token == kv == 819_200
    assert near(plan.memory.kv_per_token, 0.8e6)
    # 40 GB less 26 GB of weights (13e9 x 2 bytes) and 1 GB of reserve: 13 GB of KV.
    budget = 40e9 - 13e9 * 2 - 1e9
    assert near(plan.memory.kv_budget, budget, 0.001)
    assert near(plan.memory.num_blocks, budget / (16 * kv))  # 991.8 blocks of 16 tokens
    # Contiguous: each sequence reserves 2048 tokens (7.7), or only its own 500 + 200 (22.7, the ~23).
    assert near(plan.concurrency.contiguous_seqs, budget / (2048 * kv))
    assert near(plan.concurrency.contiguous_own_seqs, budget / (700 * kv))
    assert near(plan.concurrency.contiguous_own_seqs, 23)
    # Paged: a running sequence holds its 500 prompt tokens and on average half its 200 outputs: 600.
    assert near(plan.concurrency.paged_seqs, budget / (600 * kv))  # 26.4
    # TPOT: (30 ms - 26 GB / 1555 GB/s) / (600 tokens x 0.82 MB / 1555 GB/s) = 42.0 sequences.
    weights_s, kv_token_s = 26e9 / 1555e9, kv / 1555e9
    assert near(plan.concurrency.tpot_batch_cap, (0.030 - weights_s) / (600 * kv_token_s))
    batch = budget / (600 * kv)
    assert plan.concurrency.batch == plan.concurrency.paged_seqs  # KV memory, not TPOT, holds the batch
    step_s = weights_s + batch * 600 * kv_token_s  # 25.0 ms
    assert near(plan.step_s, step_s)
    replica_req_s = batch / step_s / 200  # 5.3 req/s
    assert near(plan.replica_req_s, replica_req_s)
    replicas = 1000 / (replica_req_s * 0.7)  # 270
    assert near(plan.replicas, replicas)
    assert near(plan.monthly_usd, replicas * 3.67 * 730)


def test_the_roofline_is_memory_bound_for_decode_and_compute_bound_for_a_prefill_chunk() -> None:
    st_ = preset_plan().step_time
    one = st_.decode_step_s(1, 600)
    assert one == pytest.approx(st_.weights_s + 600 * st_.kv_token_s)
    chunk = st_.step_s(2048, 2048)
    assert chunk == pytest.approx(2048 * st_.token_s) and chunk > st_.weights_s + 2048 * st_.kv_token_s


ACCELERATOR = st.builds(
    Accelerator,
    name=st.just("a"),
    memory_gb=st.floats(30, 200),
    bandwidth_gb_s=st.floats(100, 5000),
    tflops=st.floats(10, 2000),
    usd_per_hour=st.just(1.0),
)


@settings(max_examples=60, deadline=None)
@given(ACCELERATOR, st.floats(1, 100))
def test_more_memory_never_gives_fewer_paged_sequences(accelerator: Accelerator, more_gb: float) -> None:
    bigger = dataclasses.replace(accelerator, memory_gb=accelerator.memory_gb + more_gb)
    plans: list[CapacityPlan | None] = []
    for acc in (accelerator, bigger):
        try:
            plans.append(plan_capacity(PRESET.model, acc, PRESET.workload, PRESET.objectives))
        except ValueError:
            plans.append(None)  # the weights or a request did not fit, or no batch holds TPOT
    small, big = plans
    if small is not None:
        assert big is not None
        assert big.concurrency.paged_seqs >= small.concurrency.paged_seqs
        assert big.concurrency.contiguous_seqs >= small.concurrency.contiguous_seqs


@settings(max_examples=60, deadline=None)
@given(ACCELERATOR, st.floats(1, 200), st.floats(0, 100))
def test_a_stricter_tpot_never_gives_a_larger_batch_cap(
    accelerator: Accelerator, tpot_ms: float, looser_by_ms: float
) -> None:
    caps = []
    for tpot in (tpot_ms, tpot_ms + looser_by_ms):
        objectives = Objectives(p99_ttft_ms=500, tpot_ms=tpot, utilisation=0.7)
        try:
            plan = plan_capacity(PRESET.model, accelerator, PRESET.workload, objectives)
        except ValueError:
            caps.append(0)
        else:
            caps.append(plan.concurrency.tpot_batch_cap)
    assert caps[0] <= caps[1]


def run(*args: str) -> str:
    out = StringIO()
    call_command("simulate", "plan", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "--params, --layers, --hidden"),
        (("--preset", "70b-tpu"), "no preset '70b-tpu'"),
        (("--preset", "13b-a100", "--accelerator", "b200"), "no accelerator preset 'b200'"),
        (("--preset", "13b-a100", "--accelerator", "l4"), "leave no room for KV"),
        (("--preset", "13b-a100", "--tpot-ms", "10"), "no batch holds a 10 ms TPOT"),
        (("--preset", "13b-a100", "--rate", "0:2,60:4"), "one rate in requests a second"),
        (("--preset", "13b-a100", "--utilisation", "1.5"), "utilisation must be in"),
        (("--preset", "13b-a100", "--prompt-tokens", "4000"), "does not fit the model's 2048-token"),
        (
            ("--params", "7B", "--layers", "32", "--hidden", "4096", "--kv-heads", "8"),
            "give both --kv-heads and --head-dim",
        ),
        (("--preset", "13b-a100", "--memory-gb", "-1"), "memory gb must be > 0"),
    ],
)
def test_bad_input_is_a_command_error_that_says_what_is_wrong(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandError, match=message.replace("(", r"\(")):
        run(*args, "--duration", "0")


def test_the_plan_prints_its_arithmetic_without_simulating_at_duration_0() -> None:
    out = run("--preset", "13b-a100", "--duration", "0")
    assert "= 819,200 B (0.82 MB)" in out
    assert "batch:        26, held by KV memory" in out
    # The 40-50 paged sequences assume KV grows from nothing: the plan shows that figure and why not
    assert "15856 tokens / 350 = 45 sequences (~159 replicas)" in out
    assert "-> 275" in out and "$736,752 a month" in out
    assert "Simulated" not in out


def test_a_plan_from_flags_alone_matches_the_preset() -> None:
    flags = PlanOverrides(
        params=13e9,
        layers=40,
        hidden=5120,
        accelerator="a100-40gb",
        rate=1000,
        prompt_tokens=(500, 500),
        output_tokens=(200, 200),
        p99_ttft_ms=500,
        tpot_ms=30,
    )
    scenario = resolve(None, flags)
    plan = plan_capacity(scenario.model, scenario.accelerator, scenario.workload, scenario.objectives)
    assert plan.replicas == preset_plan().replicas  # full multi-head attention: the same KV
    assert set(ACCELERATORS) >= {"a100-40gb", "a100-80gb", "h100-80gb", "l4"}
    assert accelerator_named("h100-80gb").memory_gb == 80


def test_a_short_simulation_at_a_small_rate_completes_and_explains_itself() -> None:
    out = run("--preset", "13b-a100", "--rate", "20", "--duration", "20", "--load-time", "5")
    assert "-> 6" in out  # 20 / (5.21 x 70%) = 5.5
    simulated = out[out.index("Simulated:") :]
    assert "6 of the 6 replicas" in simulated
    finished, total = simulated.split(" requests finished")[0].split("\n")[-1].strip().split(" of ")
    assert finished == total and int(total) > 300
    assert "the autoscaler held" in simulated and "steps took" in simulated


def test_the_simulation_is_deterministic_and_its_figures_are_finite() -> None:
    plan = preset_plan()
    quick = SimulationSettings(duration_s=8, sample_replicas=2, warmup_s=2, load_time_s=5)
    first, again = simulate_plan(plan, quick), simulate_plan(plan, quick)
    assert first.num_finished == first.num_requests > 0
    assert (first.p99_ttft_ms, first.p99_tpot_ms) == (again.p99_ttft_ms, again.p99_tpot_ms)
    assert math.isfinite(first.p99_tpot_ms) and first.scale == pytest.approx(plan.replicas / 2)
