"""Rollouts across real gateway processes: two `manage.py serve` processes (embedded mode, each with its
own replicas) on one database; a canary of v2 at 50%, rolled back through the API, several times.

Every gateway must stop routing to v2 within 1 s of the rollback's response, and a caller pinned to v1
must get v1 on every request throughout. The harness (processes, client threads, the measurement) is
the rollback benchmark's, so the figures in docs/benchmarks.md come from the code tested here."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serving.benchmarks.rollback_bench import RollbackRun, canary_then_rollback
from serving.benchmarks.rollback_platform import Platform, throwaway_postgres
from serving.benchmarks.rollback_traffic import Sample, Traffic

pytestmark = pytest.mark.live_server_process
NUM_RUNS = 3
NUM_GATEWAYS = 2
# Per gateway: two unpinned clients (a request every 80 ms at most, each) and one pinned to v1, so the
# demo tenant's 50 requests/s per gateway process is never reached.
MIN_INTERVAL_S = 0.08


@dataclass
class Seen:
    runs: list[RollbackRun]
    samples: list[Sample]
    client_errors: list[str]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seen]:
    state_dir: Path = tmp_path_factory.mktemp("two-gateways")
    with contextlib.ExitStack() as stack:
        database_url = os.environ.get("DATABASE_URL", "")
        if database_url.startswith(("postgres://", "postgresql://")):
            database_url = stack.enter_context(throwaway_postgres(database_url))
        platform = Platform(
            state_dir,
            num_gateways=NUM_GATEWAYS,
            env_overrides={
                # Provisioning ends at the first judge tick after the candidate's replica is ready.
                "SWITCHYARD_ROLLOUT_JUDGE_INTERVAL_S": "0.5",
                "SWITCHYARD_REPLICA_SYNC_INTERVAL_S": "0.5",
            },
            database_url=database_url or None,
        )
        platform.prepare()
        platform.register("v2")
        stack.callback(platform.stop)
        platform.start()
        key = platform.tenant_key("deployer")  # may deploy demo-chat (granted it) and pin
        clients = [(g, pin) for g in range(NUM_GATEWAYS) for pin in (None, None, "v1")]
        with Traffic(platform, key, clients=clients, max_tokens=1, min_interval_s=MIN_INTERVAL_S) as traffic:
            runs = [
                canary_then_rollback(platform, traffic, key, candidate="v2", via_gateway=i % NUM_GATEWAYS)
                for i in range(NUM_RUNS)
            ]
        for number, run in enumerate(runs, 1):
            lags = ", ".join(f"{1000 * o.lag_s:.0f} ms" for o in run.per_gateway)
            sys.stdout.write(
                f"run {number}: last request routed to v2 after the rollback, per gateway: {lags}\n"
            )
        yield Seen(runs, traffic.samples(), traffic.errors)
        if os.environ.get("CI"):
            for log in sorted(state_dir.glob("gateway-*.log")):
                sys.stderr.write(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}\n")


def test_every_gateway_stops_routing_to_the_canary_within_1s_of_the_rollback(rollouts: Seen) -> None:
    assert not rollouts.client_errors
    for run in rollouts.runs:
        for gateway, seen in enumerate(run.per_gateway):
            where = f"deployment {run.deployment_id}, gateway {gateway}"
            assert seen.num_canary_before > 0, f"{where}: v2 had no traffic just before the rollback"
            assert seen.lag_s <= 1.0, f"{where}: a request sent {seen.lag_s:.3f} s after the rollback got v2"
            # Each of these had an even chance of landing on v2 had the gateway kept the old table.
            assert seen.num_after_limit >= 10, f"{where}: too few requests after the limit to tell"
            assert seen.num_canary_after_limit == 0


def test_a_caller_pinned_to_v1_gets_v1_throughout_ramps_and_rollbacks(rollouts: Seen) -> None:
    pinned = [s for s in rollouts.samples if s.pin == "v1"]
    assert {(s.status, s.version) for s in pinned} == {(200, "v1")}
    # The pin held while the split sent unpinned callers to v2, on both gateways and in every run.
    for run in rollouts.runs:
        ramp_start = min(
            s.sent_at for s in rollouts.samples if s.version == "v2" and s.sent_at > run.created_at
        )
        for gateway in range(NUM_GATEWAYS):
            during = [
                s for s in pinned if s.gateway == gateway and ramp_start <= s.sent_at <= run.rollback_at
            ]
            assert during, (
                f"deployment {run.deployment_id}: no pinned request on gateway {gateway} in the ramp"
            )
