"""`manage.py demo_rollout`: a good version promoted and a bad one rolled back, by the judge, under load.

Runs the platform in this process, as `make serve` does in its embedded mode: the data-plane runtime
with in-process replicas (one per version with traffic or an alias), load through the same dispatch path
the HTTP views use (gateway quota, router, replica), replicas flushing their metrics to the store, and
the rollout judge run by the embedded scheduler (config.periodic) on the beat schedule's task. The
bad version gets an injected step delay through SWITCHYARD_FAULTS' setting (serving.replica.faults), set here
for that one version only.

Why in-process rather than a `serve` subprocess plus HTTP load: nothing to bind or clean up, the
readiness hook can ask the runtime whether the candidate's replica is loaded, and the load generator
sees which version served each request at the instant it was routed (for the rollback measurement).
The path a request takes from dispatch on is the same one an HTTP request takes.

It works on a model of its own, demo-rollout (made from the demo model's files the first time), never on
the demo-chat that `make serve` serves: it writes to the configured database (new versions of
demo-rollout and two deployments). Its judge takes the database's judge lease (rollouts/judge_lease.py):
while another process judges there (a server, Celery beat), it says so and stops rather than race it."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from audit import actors
from rollouts import judge_lease

MODEL = "demo-rollout"
SOURCE_MODEL = "demo-model"  # seed_demo's directory under STATE_DIR: demo-chat's files
ACTOR = actors.command(__name__)
JUDGE_TASK = "rollouts.tasks.rollout_judge_tick"
PROMPTS = [
    "Once upon a time there was a little train",
    "The quick brown fox",
    "Beautiful is better than ugly.",
    "Hello, world! How are you today?",
    "A request arrives at the gateway",
]

_runtime: Any = None  # the runtime of this command's loop, for the readiness hook


def candidate_replica_is_ready(deployment: Any) -> bool:
    """Readiness hook (settings.ROLLOUT_READINESS_CHECK) for the demo: the candidate's in-process
    replica has loaded its model. Called from the scheduler's thread; it only reads attributes."""
    if _runtime is None:
        return False
    replica = _runtime.replicas.get((deployment.model.name, deployment.candidate.version))
    return replica is not None and replica.is_ready


@dataclass
class Load:
    """Closed-loop load: `concurrency` clients, each sending its next request when the last ends."""

    num_by_version: Counter[str] = field(default_factory=Counter)
    num_errors_by_version: Counter[str] = field(default_factory=Counter)
    tpot_ms: list[float] = field(default_factory=list)
    last_routed_at: dict[str, float] = field(default_factory=dict)  # version -> wall time it arrived
    refusals: Counter[str] = field(default_factory=Counter)

    def baseline_tpot_p99_ms(self) -> float | None:
        if not self.tpot_ms:
            return None
        ordered = sorted(self.tpot_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Command(BaseCommand):
    help = (
        "Register a good and a bad (injected step delay) version of demo-rollout, run load in-process, and "
        "let the rollout judge promote the good one and roll back the bad one, printing every step."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--steps", default="10,50,100", help="canary steps in percent (default 10,50,100)"
        )
        parser.add_argument("--bake-seconds", type=int, default=20)
        parser.add_argument("--judge-interval", type=float, default=settings.ROLLOUT_JUDGE_INTERVAL_S)
        parser.add_argument("--min-samples", type=int, default=30)
        parser.add_argument("--delay-ms", type=float, default=40.0, help="step delay injected in the bad one")
        parser.add_argument("--concurrency", type=int, default=8)
        parser.add_argument("--max-tokens", type=int, default=16)
        parser.add_argument("--timeout", type=float, default=150.0, help="seconds allowed per deployment")
        parser.add_argument(
            "--tpot-sla-ms", type=float, default=None, help="the deployments' TPOT SLA (default: delay / 2)"
        )
        parser.add_argument(
            "--torch-threads",
            type=int,
            default=1,
            help="torch intra-op threads; several replicas share this process, and on a small CPU more "
            "than one thread per op made each step ~100x slower (OpenMP threads spinning for cores)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        steps = [{"pct": int(p)} for p in str(options["steps"]).split(",") if p.strip()]
        options["steps"] = steps
        ok = asyncio.run(self._main(options))
        if not ok:
            raise CommandError("the demo did not end as expected (see above)")

    # --- output --------------------------------------------------------------------------------------

    def _say(self, t0: float, text: str) -> None:
        self.stdout.write(f"[{time.monotonic() - t0:6.1f}s] {text}")
        self.stdout.flush()

    # --- the demo ------------------------------------------------------------------------------------

    async def _main(self, options: dict[str, Any]) -> bool:
        global _runtime
        import torch

        from config.periodic import run_periodic_tasks
        from serving.runtime import get_runtime, shutdown_runtime

        torch.set_num_threads(options["torch_threads"])
        t0 = time.monotonic()
        good, bad = await sync_to_async(self._prepare)(options, t0)
        settings.ROLLOUT_READINESS_CHECK = f"{__name__}.candidate_replica_is_ready"
        settings.METRICS_FLUSH_INTERVAL_S = min(settings.METRICS_FLUSH_INTERVAL_S, 1.0)

        _runtime = await get_runtime()
        await _runtime.wait_ready()
        self._say(t0, f"runtime up: replicas {sorted(v for _, v in _runtime.replicas)}")
        load = Load()
        clients = [
            asyncio.create_task(self._client(i, load, options["max_tokens"]))
            for i in range(options["concurrency"])
        ]
        beat = asyncio.create_task(
            run_periodic_tasks({"rollout-judge": {"task": JUDGE_TASK, "schedule": options["judge_interval"]}})
        )
        try:
            await asyncio.sleep(5)  # the incumbent under load before anything changes
            load.tpot_ms.clear()
            served_before = sum(load.num_by_version.values())
            await asyncio.sleep(5)
            served = sum(load.num_by_version.values()) - served_before
            # The SLA is a floor under the judge's relative limit (incumbent p99 x 1.25); the demo puts it
            # at half the injected delay, above a healthy demo model's TPOT and below the bad one's.
            tpot_sla_ms = options["tpot_sla_ms"] or options["delay_ms"] / 2
            self._say(
                t0,
                f"load: {options['concurrency']} clients, {served / 5:.1f} req/s, client-side p99 TPOT "
                f"{_ms(load.baseline_tpot_p99_ms())}; thresholds: min_samples {options['min_samples']}, "
                f"tpot_sla_ms {tpot_sla_ms:g} (other thresholds: settings.ROLLOUT_THRESHOLDS)",
            )
            thresholds = {"min_samples": options["min_samples"], "tpot_sla_ms": tpot_sla_ms}
            promoted = await self._deploy(good, "promoted", thresholds, options, load, t0)
            rolled_back = await self._deploy(bad, "rolled_back", thresholds, options, load, t0)
        finally:
            beat.cancel()
            for task in clients:
                task.cancel()
            await asyncio.gather(beat, *clients, return_exceptions=True)
            await sync_to_async(judge_lease.release)()  # another process may judge at once
            await shutdown_runtime()
            _runtime = None
        self._say(
            t0,
            f"requests served by version: {dict(load.num_by_version)}; errors: "
            f"{dict(load.num_errors_by_version)}; refused: {dict(load.refusals) or 0}",
        )
        return promoted and rolled_back

    def _prepare(self, options: dict[str, Any], t0: float) -> tuple[str, str]:
        """demo-rollout exists; any deployment left in flight by an interrupted run is rolled back; the
        next two free version names are registered; the second gets the injected delay."""
        from registry.models import Alias, Model
        from registry.services import model_version_register
        from rollouts import selectors, services

        judge_lease.judge_here()
        try:
            other = judge_lease.held_by_another()
        except DatabaseError:  # a database not migrated yet: no process has judged there
            other = None
        if other is not None:
            raise CommandError(
                f"another process judges the deployments of this database ({other}: a server, or Celery "
                "beat), and would judge the demo's too without its readiness check. Stop it, or give the "
                "demo a state of its own: SWITCHYARD_STATE_DIR=/tmp/demo-rollout .venv/bin/python manage.py "
                "demo_rollout"
            )
        call_command("migrate", "--noinput", verbosity=0)
        call_command("seed_demo", "--no-key", stdout=self.stdout)  # the demo model's files
        source = Path(settings.STATE_DIR) / SOURCE_MODEL
        if not Model.objects.filter(name=MODEL).exists():
            model_version_register(
                name=MODEL, version="v1", source_dir=source, created_by="demo_rollout", actor=ACTOR
            )
            self._say(t0, f"registered {MODEL}:v1 (stable), from {source}")
        model = Model.objects.get(name=MODEL)
        left = selectors.deployment_in_flight(model=model)
        if left is not None:
            services.deployment_rollback(deployment=left, actor=ACTOR, reason="left by an earlier run")
            self._say(t0, f"rolled back deployment {left.pk}, left in flight by an earlier run")
        stable = Alias.objects.get(model=model, name="stable").version
        existing = set(model.versions.values_list("version", flat=True))
        names = (f"v{n}" for n in range(2, 10_000) if f"v{n}" not in existing)
        good, bad = next(names), next(names)
        faults = f"{MODEL}:{bad}=delay_ms:{options['delay_ms']:g}"
        settings.FAULTS = ";".join(filter(None, [settings.FAULTS, faults]))
        settings.ALLOW_FAULT_INJECTION = True  # this process only: the demo's bad version needs it
        for version, note in ((good, "same weights, healthy"), (bad, f"same weights, {faults}")):
            model_version_register(
                name=MODEL,
                version=version,
                source_dir=source,
                created_by="demo_rollout",
                parent=stable,
                actor=ACTOR,
            )
            self._say(t0, f"registered {MODEL}:{version} ({note}); stable is {stable.version}")
        return good, bad

    async def _client(self, index: int, load: Load, max_tokens: int) -> None:
        from registry.selectors import TenantContext
        from serving.gateway.dispatch import dispatch
        from serving.gateway.errors import GatewayError

        context = TenantContext.unlimited("demo-load")
        rng = random.Random(index)
        params = {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []}
        while True:
            arrived = time.time()
            try:
                handle = await dispatch(
                    context=context, path_model=MODEL, pin=None, params=params, text=rng.choice(PROMPTS)
                )
            except GatewayError as exc:
                load.refusals[f"{exc.status} {exc.message}"] += 1
                await asyncio.sleep(0.2)
                continue
            load.last_routed_at[handle.version] = arrived
            load.num_by_version[handle.version] += 1
            try:
                async for event in handle.events():
                    if event.get("finish_reason") == "error":
                        load.num_errors_by_version[handle.version] += 1
                    timings = event.get("timings")
                    usage = event.get("usage") or {}
                    if (
                        timings
                        and timings.get("ttft_s") is not None
                        and usage.get("completion_tokens", 0) > 1
                    ):
                        tpot_s = (timings["total_s"] - timings["ttft_s"]) / (usage["completion_tokens"] - 1)
                        load.tpot_ms.append(tpot_s * 1000)
            finally:
                await handle.close()

    async def _deploy(
        self,
        version: str,
        expected: str,
        thresholds: dict[str, Any],
        options: dict[str, Any],
        load: Load,
        t0: float,
    ) -> bool:
        from registry.models import Model
        from rollouts import judge_tick, selectors, services

        @sync_to_async
        def create() -> int:
            return services.deployment_create(
                model=Model.objects.get(name=MODEL),
                version=version,
                created_by=ACTOR,
                steps=options["steps"],
                bake_seconds=options["bake_seconds"],
                thresholds=thresholds,
            ).pk

        @sync_to_async
        def read(deployment_id: int) -> dict[str, Any]:
            deployment = selectors.deployment_get(deployment_id=deployment_id)
            assert deployment is not None
            return selectors.deployment_detail(deployment=deployment)

        deployment_id = await create()
        self._say(
            t0,
            f"deployment {deployment_id}: canary of {version}, steps "
            f"{' -> '.join(str(s['pct']) + '%' for s in options['steps'])}, bake "
            f"{options['bake_seconds']} s, judge every {options['judge_interval']:g} s",
        )
        num_events = 0
        last_judged = None
        deadline = time.monotonic() + options["timeout"]
        while True:
            detail = await read(deployment_id)
            if detail["last_judged_at"] != last_judged and detail["last_verdict"]:
                last_judged = detail["last_judged_at"]
                verdict = detail["last_verdict"]
                if verdict["verdict"] in ("hold", "insufficient_data"):
                    self._say(t0, f"  judge: {verdict['verdict']:17s} {_figures(verdict['figures'])}")
            for event in detail["events"][num_events:]:
                self._say(
                    t0,
                    f"  {event['from_state'] or '-'} -> {event['to_state']} ({event['actor']}): "
                    f"{event['reason']}",
                )
                if event["figures"].get("canary"):
                    self._say(t0, f"      {_figures(event['figures'])}")
            num_events = len(detail["events"])
            if detail["state"] in ("promoted", "rolled_back", "completed"):
                break
            if time.monotonic() > deadline:
                self._say(t0, f"  timed out in state {detail['state']}; rolling back")
                await sync_to_async(self._rollback)(deployment_id)
                return False
            await asyncio.sleep(0.25)

        state = detail["state"]
        if state == "rolled_back":
            await asyncio.sleep(1.5)  # let requests that were already routed show up
            rollback = detail["rollback"]
            decided = rollback["decided_at"].timestamp()
            committed = (rollback["committed_at"] or rollback["decided_at"]).timestamp()
            last = load.last_routed_at.get(version)
            last_note = (
                f"last request routed to {version} arrived {1000 * (last - decided):+.0f} ms from the "
                f"decision ({1000 * (last - committed):+.0f} ms from the commit)"
                if last is not None
                else f"no request was ever routed to {version}"
            )
            self._say(
                t0,
                f"  rollback: {_edit(rollback['edit_ms'])}, committed "
                f"{1000 * (committed - decided):.0f} ms after the decision; {last_note}",
            )
        by_judge = detail["events"][-1]["actor"] == judge_tick.JUDGE_ACTOR or (
            state == "rolled_back" and detail["events"][-2]["actor"] == judge_tick.JUDGE_ACTOR
        )
        ok = state == expected and by_judge
        self._say(
            t0, f"deployment {deployment_id} ({version}): {state}{'' if ok else f' (expected {expected})'}"
        )
        return ok

    def _rollback(self, deployment_id: int) -> None:
        from rollouts import selectors, services

        deployment = selectors.deployment_get(deployment_id=deployment_id)
        if deployment is not None and deployment.is_in_flight:
            services.deployment_rollback(deployment=deployment, actor=ACTOR, reason="demo timed out")


def _figures(figures: dict[str, Any]) -> str:
    canary, incumbent = figures.get("canary"), figures.get("incumbent")
    if not canary or not incumbent:
        return ""

    def one(name: str, w: dict[str, Any]) -> str:
        return (
            f"{name} n={w['num_requests']} err={100 * (w['error_rate'] or 0):.1f}% "
            f"p99 TTFT={_ms(w['ttft_p99_ms'])} TPOT={_ms(w['tpot_p99_ms'])}"
        )

    p = figures.get("errors_test", {}).get("p_value")
    return (
        f"{one('canary', canary)} | {one('incumbent', incumbent)} "
        f"| TPOT limit {_ms(figures.get('tpot_limit_ms'))}"
        + (f" | errors p={p:.2g}" if p is not None else "")
        + f" | baked {figures.get('bake_elapsed_s', 0):.0f}/{figures.get('bake_seconds', 0)} s"
    )


def _edit(edit_ms: float | None) -> str:
    return "no routing edit" if edit_ms is None else f"routing edit {edit_ms:.1f} ms"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}ms"
