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


class Command(BaseCommand):
    help = (
        "Simulate a fleet on a virtual clock (rollouts/fleet/simulator.py): the real scheduler and KV cache "
        "in every replica with a latency model for the forward pass, the router's replica choice, and the "
        "autoscaler's policy (SWITCHYARD_AUTOSCALER_*, or the flags) under a load that changes. "
        "`--compare-static N` runs the same requests on N replicas that never scale, and prints the ratios."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("what", choices=["fleet"])
        parser.add_argument("--rate", default="0:2,120:16,300:2", help="FROM_S:REQUESTS_PER_S,… (Poisson)")
        parser.add_argument("--duration", type=float, default=420.0, help="seconds of arrivals")
        parser.add_argument("--prompt-tokens", default="64-512")
        parser.add_argument("--output-tokens", default="64-256")
        parser.add_argument("--seed", type=int, default=0)
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
        from rollouts.fleet.autoscaler import ScalingPolicy
        from rollouts.fleet.simulator import FleetConfig, parse_rate_profile, poisson_arrivals, simulate_fleet
        from serving.engine.scheduler import SchedulerConfig
        from serving.engine.simulated import LatencyModel

        try:
            profile = parse_rate_profile(options["rate"])
            overrides = {name: options[name] for name in _POLICY_FLAGS if options[name] is not None}
            if overrides.get("target_tpot_ms") == 0:
                overrides["target_tpot_ms"] = None
            policy = ScalingPolicy(**{**settings.AUTOSCALER, **overrides})
            scheduler = SchedulerConfig(
                max_num_seqs=options["max_num_seqs"], max_num_batched_tokens=options["max_num_batched_tokens"]
            )
            scheduler.validate()
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
            latency=LatencyModel(
                options["step_ms"],
                options["prefill_token_ms"],
                options["decode_seq_ms"],
                options["context_token_ms"],
            ),
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
