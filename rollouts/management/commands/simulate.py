import dataclasses
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from serving.benchmarks.workload import percentile  # numpy's default, as every bench here


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    values = (int(low), int(high or low))
    if not 1 <= values[0] <= values[1]:
        raise ValueError(f"need 1 <= low <= high, got {text!r}")
    return values


# ScalingPolicy's fields a flag may set over the settings' (SWITCHYARD_AUTOSCALER_*), with their types.
_POLICY_FLAGS: dict[str, type] = {
    **dict.fromkeys(("min_replicas", "max_replicas", "warm_buffer"), int),
    **dict.fromkeys(
        (
            "target_queue_per_replica",
            "target_saturation",
            "target_kv_usage",
            "scale_down_window_s",
            "target_tpot_ms",  # 0: no step-time signal
        ),
        float,
    ),
}


# `simulate fleet`'s defaults for the flags `simulate plan` shares (a plan's come from its preset).
_FLEET_DEFAULTS = {
    "rate": "0:2,120:16,300:2",
    "duration": 420.0,
    "prompt_tokens": "64-512",
    "output_tokens": "64-256",
}


class Command(BaseCommand):
    help = (
        "Simulate a fleet on a virtual clock (rollouts/fleet/simulator.py): the real scheduler and KV cache "
        "in every replica with a latency model for the forward pass, the router's replica choice, and the "
        "autoscaler's policy (SWITCHYARD_AUTOSCALER_*, or the flags) under a load that changes. "
        "`--compare-static N` runs the same requests on N replicas that never scale, and prints the ratios. "
        "`simulate plan` sizes a fleet for a model, an accelerator, a load and latency objectives "
        "(docs/capacity.md), and runs the plan through the same simulator. "
        "`simulate slo` offers a static fleet --overload times its measured capacity and compares, on the "
        "same arrivals, routing with and without the gateway's SLO-aware admission (docs/benchmarks.md)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("what", choices=["fleet", "plan", "slo"])
        parser.add_argument(
            "--rate", default=None, help="fleet: FROM_S:REQUESTS_PER_S,… (Poisson); plan: requests a second"
        )
        parser.add_argument(
            "--duration",
            type=float,
            default=None,
            help="seconds of arrivals (fleet 420, plan 600, slo 60; plan 0: none)",
        )
        parser.add_argument("--prompt-tokens", default=None, help="N or LOW-HIGH (fleet: 64-512)")
        parser.add_argument("--output-tokens", default=None, help="N or LOW-HIGH (fleet: 64-256)")
        parser.add_argument("--seed", type=int, default=0)
        _add_plan_arguments(parser)
        _add_slo_arguments(parser)
        policy = parser.add_argument_group("the autoscaler (defaults: the settings)")
        for name, kind in _POLICY_FLAGS.items():
            policy.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
        fleet = parser.add_argument_group("the replicas")
        fleet.add_argument("--load-time", type=float, default=30.0, help="seconds from decision to ready")
        fleet.add_argument("--tick", type=float, default=None, help="autoscaler interval (settings: 5 s)")
        fleet.add_argument("--max-num-seqs", type=int, default=settings.REPLICA_MAX_NUM_SEQS)
        fleet.add_argument(
            "--max-num-batched-tokens", type=int, default=settings.REPLICA_MAX_NUM_BATCHED_TOKENS
        )
        fleet.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of 16 tokens per replica")
        # A step of a 7B model on one GPU, roughly: ~12 ms a step, plus its tokens and sequences.
        fleet.add_argument("--step-ms", type=float, default=12.0)
        fleet.add_argument("--prefill-token-ms", type=float, default=0.15)
        fleet.add_argument("--decode-seq-ms", type=float, default=0.25)
        fleet.add_argument("--context-token-ms", type=float, default=0.0005)
        parser.add_argument("--ttft-sla-ms", type=float, default=1000.0)
        parser.add_argument("--every", type=float, default=30.0, help="seconds between printed rows")
        parser.add_argument("--compare-static", type=int, default=None, metavar="N")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["what"] == "plan":
            self._plan(options)
            return
        if options["what"] == "slo":
            self._slo(options)
            return
        options.update({k: v for k, v in _FLEET_DEFAULTS.items() if options[k] is None})
        from rollouts.fleet.simulator import FleetConfig, parse_rate_profile, poisson_arrivals, simulate_fleet

        try:
            profile = parse_rate_profile(options["rate"])
            policy = _policy(options)
            scheduler = _scheduler(options)
            requests = poisson_arrivals(
                profile,
                options["duration"],
                prompt_tokens=_range(options["prompt_tokens"]),
                output_tokens=_range(options["output_tokens"]),
                seed=options["seed"],
            )
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        interval = float(settings.CELERY_BEAT_SCHEDULE["autoscaler"]["schedule"])  # type: ignore[arg-type]
        config = FleetConfig(
            policy=policy,
            scheduler=scheduler,
            num_blocks=options["num_blocks"],
            latency=_latency(options),
            load_time_s=options["load_time"],
            tick_s=options["tick"] or interval,
            initial_replicas=max(1, policy.min_replicas),
            ttft_sla_s=options["ttft_sla_ms"] / 1000,
        )
        self.stdout.write(
            f"{len(requests)} requests over {options['duration']:g} s at {options['rate']} req/s; replicas "
            f"{policy.min_replicas}-{policy.max_replicas}, ready {config.load_time_s:g} s after the decision"
        )
        started = time.perf_counter()
        report = simulate_fleet(requests, config, seed=options["seed"])
        self.stdout.write(f"autoscaled (simulated in {time.perf_counter() - started:.1f} s):")
        self.stdout.write("      t  req/s  target  ready  starting  draining  queued  KV use  step ms")
        shown = -float("inf")
        for row in report.rows:
            if row.at_s - shown >= options["every"]:
                shown = row.at_s
                self.stdout.write(
                    f"{row.at_s:7.0f}  {row.arrival_rate:5.1f}  {row.target:6d}  {row.ready:5d}  "
                    f"{row.starting:8d}  {row.draining:8d}  {row.queued:6d}  "
                    f"{row.kv_cache_usage:6.1%}  {row.step_ms:7.1f}"
                )
        self._summary("autoscaled", report)
        if options["compare_static"] is not None:
            n = options["compare_static"]
            if n < 1:
                raise CommandError("--compare-static needs at least 1 replica")
            static_policy = dataclasses.replace(policy, min_replicas=n, max_replicas=n, warm_buffer=0)
            static = simulate_fleet(
                requests,
                dataclasses.replace(config, policy=static_policy, initial_replicas=n),
                seed=options["seed"],
            )
            self._summary(f"static {n}", static)
            cost = report.replica_seconds / static.replica_seconds
            p99 = percentile(report.ttft_s, 99) / percentile(static.ttft_s, 99)
            self.stdout.write(
                f"autoscaled / static {n}: replica-seconds {cost:.2f}, p99 TTFT {p99:.2f}, "
                f"SLA attainment {report.sla_attainment:.1%} vs {static.sla_attainment:.1%}"
            )

    def _summary(self, name: str, report: Any) -> None:
        def ms(values: list[float], q: float) -> float:
            return percentile(values, q) * 1000

        self.stdout.write(
            f"{name}: {len(report.ttft_s)} of {report.num_requests} finished; TTFT p50 "
            f"{ms(report.ttft_s, 50):.0f} ms, p99 {ms(report.ttft_s, 99):.0f} ms; TPOT p99 "
            f"{ms(report.tpot_s, 99):.1f} ms; TTFT within {report.ttft_sla_s * 1000:.0f} ms: "
            f"{report.sla_attainment:.1%}; replica-seconds {report.replica_seconds:.0f}"
        )

    def _slo(self, options: dict[str, Any]) -> None:
        from rollouts.fleet.simulator import FleetConfig  # deferred: a command loads what it runs
        from rollouts.fleet.slo_experiment import SloSettings, compare
        from rollouts.fleet.slo_report import slo_lines

        if options["rate"] is not None:
            raise CommandError("`simulate slo` sets its rate: --overload times the fleet's capacity")
        defaults = {**_FLEET_DEFAULTS, "duration": 60.0}
        options.update({k: v for k, v in defaults.items() if options[k] is None})
        try:
            slo = SloSettings(
                replicas=options["replicas"],
                objective_s=options["ttft_objective_ms"] / 1000,
                overload=options["overload"],
                duration_s=options["duration"],
                capacity_rps=options["capacity"],
                prompt_tokens=_range(options["prompt_tokens"]),
                output_tokens=_range(options["output_tokens"]),
                seed=options["seed"],
            )
            fleet = FleetConfig(
                policy=_policy(options),  # pinned to --replicas: a static fleet
                scheduler=_scheduler(options),
                num_blocks=options["num_blocks"],
                latency=_latency(options),
            )
            result = compare(fleet, slo)
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        for line in slo_lines(result):
            self.stdout.write(line)

    def _plan(self, options: dict[str, Any]) -> None:
        from rollouts.fleet.capacity_plan import plan_capacity  # deferred: a command loads what it runs
        from rollouts.fleet.plan_inputs import PlanOverrides, resolve
        from rollouts.fleet.plan_report import plan_lines, simulation_lines
        from rollouts.fleet.plan_simulation import SimulationSettings, simulate_plan

        try:
            given = PlanOverrides(
                **{name: options[name] for name in _PLAN_FLAGS},
                rate=_rate(options["rate"]),
                prompt_tokens=_range(options["prompt_tokens"]) if options["prompt_tokens"] else None,
                output_tokens=_range(options["output_tokens"]) if options["output_tokens"] else None,
            )
            scenario = resolve(options["preset"], given)
            plan = plan_capacity(
                scenario.model,
                scenario.accelerator,
                scenario.workload,
                scenario.objectives,
                reserve_gb=options["reserve_gb"],
                block_size=options["block_size"],
            )
            duration = 600.0 if options["duration"] is None else options["duration"]
            sim_settings = (
                SimulationSettings(
                    duration_s=duration,
                    sample_replicas=options["sample_replicas"],
                    load_time_s=options["load_time"],
                    tick_s=options["tick"] or float(settings.AUTOSCALER_INTERVAL_S),
                    warmup_s=min(60.0, duration / 4),
                    seed=options["seed"],
                )
                if duration > 0
                else None
            )
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        for line in plan_lines(plan):
            self.stdout.write(line)
        if sim_settings is not None:
            for line in simulation_lines(plan, simulate_plan(plan, sim_settings), sim_settings):
                self.stdout.write(line)


def _policy(options: dict[str, Any]) -> Any:
    """The autoscaler's policy: the settings' (SWITCHYARD_AUTOSCALER_*), with the flags over them."""
    from rollouts.fleet.autoscaler import ScalingPolicy  # deferred: a command loads what it runs

    overrides = {name: options[name] for name in _POLICY_FLAGS if options[name] is not None}
    if overrides.get("target_tpot_ms") == 0:
        overrides["target_tpot_ms"] = None
    return ScalingPolicy(**{**settings.AUTOSCALER, **overrides})


def _scheduler(options: dict[str, Any]) -> Any:
    from serving.engine.scheduler import SchedulerConfig  # deferred: a command loads what it runs

    scheduler = SchedulerConfig(
        max_num_seqs=options["max_num_seqs"], max_num_batched_tokens=options["max_num_batched_tokens"]
    )
    scheduler.validate()
    return scheduler


def _latency(options: dict[str, Any]) -> Any:
    from serving.engine.simulated import LatencyModel  # deferred: a command loads what it runs

    return LatencyModel(
        options["step_ms"], options["prefill_token_ms"], options["decode_seq_ms"], options["context_token_ms"]
    )


def _rate(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"a plan's --rate is one rate in requests a second, got {text!r}") from None


def parameter_count(text: str) -> float:
    """'13e9', '13B', '350M' -> a number."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}.get(text[-1:].lower(), 1.0)
    return float(text[:-1] if scale != 1.0 else text) * scale


# PlanOverrides' fields that a flag of the same name sets, with their types.
_PLAN_FLAGS: dict[str, Any] = {
    "model_name": str,
    "params": parameter_count,
    **dict.fromkeys(("layers", "hidden", "kv_heads", "head_dim", "max_context"), int),
    **dict.fromkeys(("kv_bytes_per_token", "dtype_bytes"), float),
    "accelerator": str,
    **dict.fromkeys(("memory_gb", "bandwidth_gb_s", "tflops", "usd_per_hour"), float),
    **dict.fromkeys(("p99_ttft_ms", "tpot_ms", "utilisation"), float),
}


def _add_plan_arguments(parser: CommandParser) -> None:
    plan = parser.add_argument_group(
        "a capacity plan (`simulate plan`): a --preset, or the model's, accelerator's, load's and "
        "objectives' figures, or a preset with some of them changed"
    )
    plan.add_argument("--preset", default=None, help="a named scenario: 13b-a100")
    for name, kind in _PLAN_FLAGS.items():
        plan.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    plan.add_argument("--reserve-gb", type=float, default=1.0, help="memory kept for activations (GB)")
    plan.add_argument("--block-size", type=int, default=16, help="tokens a KV block")
    plan.add_argument(
        "--sample-replicas", type=int, default=8, help="replicas simulated, with their share of the rate"
    )


def _add_slo_arguments(parser: CommandParser) -> None:
    slo = parser.add_argument_group(
        "SLO-aware admission at overload (`simulate slo`): a static fleet at --overload times its "
        "capacity, with and without the gateway's admission; the replicas' flags below apply"
    )
    slo.add_argument("--replicas", type=int, default=4, help="static replicas (4)")
    slo.add_argument("--ttft-objective-ms", type=float, default=1000.0, help="every request's (1000)")
    slo.add_argument("--overload", type=float, default=1.5, help="the rate over the capacity (1.5)")
    slo.add_argument(
        "--capacity", type=float, default=None, help="req/s (default: measured, see docs/benchmarks.md)"
    )
