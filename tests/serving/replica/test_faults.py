"""Fault injection: parsed from settings or run_replica's flags, refused without DEBUG unless allowed,
and visible to the client and in the metrics when on."""

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import AsyncClient

from serving.replica.faults import (
    FaultInjectionRefused,
    Faults,
    FaultSpecError,
    configured_faults,
    parse_faults,
)
from tests.conftest import REPO_ROOT


def test_the_settings_spec_parses_per_version() -> None:
    faults = parse_faults("demo-chat:v3=delay_ms:40,error_rate:0.2; other:v1=error_rate:1,seed:7")
    assert faults == {
        ("demo-chat", "v3"): Faults(step_delay_ms=40, error_rate=0.2),
        ("other", "v1"): Faults(error_rate=1.0, seed=7),
    }
    assert parse_faults("") == {}
    for bad in ("demo-chat=delay_ms:4", "demo-chat:v3=speed:4", "m:v=error_rate:2", "m:v=delay_ms:x"):
        with pytest.raises(FaultSpecError):
            parse_faults(bad)


def test_settings_faults_are_refused_without_debug_unless_allowed(settings) -> None:
    settings.DEBUG = False
    settings.ALLOW_FAULT_INJECTION = False
    settings.FAULTS = "demo-chat:v3=delay_ms:40"
    assert configured_faults("demo-chat", "v1") is None  # not this version: nothing to refuse
    with pytest.raises(FaultInjectionRefused):
        configured_faults("demo-chat", "v3")
    settings.ALLOW_FAULT_INJECTION = True
    assert configured_faults("demo-chat", "v3") == Faults(step_delay_ms=40)
    settings.ALLOW_FAULT_INJECTION = False
    settings.DEBUG = True
    assert configured_faults("demo-chat", "v3") == Faults(step_delay_ms=40)


def test_the_server_refuses_to_start_with_faults_and_no_permission() -> None:
    env = {"PATH": "/usr/bin:/bin", "SWITCHYARD_FAULTS": "demo-chat:v3=error_rate:0.5", "DEBUG": "0"}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "fault injection is refused" in result.stderr
    allowed = {**env, "SWITCHYARD_ALLOW_FAULT_INJECTION": "1"}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=REPO_ROOT, env=allowed, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_run_replica_refuses_injection_flags_without_debug(settings) -> None:
    settings.DEBUG = False
    settings.ALLOW_FAULT_INJECTION = False
    settings.REDIS_URL = None
    args = ["run_replica", "--model", "demo-chat", "--version", "v1"]
    with pytest.raises(CommandError, match="fault injection is refused"):
        call_command(*args, "--inject-step-delay-ms", "40")
    with pytest.raises(CommandError, match="fault injection is refused"):
        call_command(*args, "--inject-error-rate", "0.2")
    settings.ALLOW_FAULT_INJECTION = True
    with pytest.raises(CommandError, match="error rate must be in"):
        call_command(*args, "--inject-error-rate", "1.5")
    with pytest.raises(CommandError, match="needs REDIS_URL"):  # past the fault check
        call_command(*args, "--inject-error-rate", "0.2")
    settings.ALLOW_FAULT_INJECTION = False
    with pytest.raises(CommandError, match="needs REDIS_URL"):  # no flags: nothing to refuse
        call_command(*args)


async def _infer(acme, **body: object):
    return await AsyncClient().post(
        "/v1/models/demo-chat/infer",
        data=json.dumps({"input": "hello", "temperature": 0, **body}),
        content_type="application/json",
        headers=acme.auth,
    )


@pytest.mark.django_db(transaction=True)
async def test_an_embedded_version_with_injected_errors_fails_its_requests(
    make_tenant, registered_model, settings
) -> None:
    from asgiref.sync import sync_to_async

    from serving.runtime import get_runtime
    from serving.telemetry.metrics_reads import version_window

    settings.ALLOW_FAULT_INJECTION = True
    settings.FAULTS = "demo-chat:v1=error_rate:1"
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    acme = await sync_to_async(make_tenant)("acme")
    started = datetime.now(tz=UTC) - timedelta(seconds=5)

    response = await _infer(acme, max_tokens=3)
    assert response.status_code == 503  # the one replica failed it; there is no other to retry on
    replica = runtime.replicas[("demo-chat", "v1")]
    await replica.flush_metrics()
    window = await sync_to_async(version_window)(
        model_name="demo-chat", version="v1", start=started, end=datetime.now(tz=UTC) + timedelta(seconds=5)
    )
    assert (window.num_requests, window.num_errors, window.errors_by_type) == (1, 1, {"injected_fault": 1})
    assert window.error_rate == 1.0 and window.output_tokens == 0


@pytest.mark.django_db(transaction=True)
async def test_an_injected_step_delay_shows_in_model_time_and_tpot(
    make_tenant, registered_model, settings
) -> None:
    from asgiref.sync import sync_to_async

    from serving.runtime import get_runtime
    from serving.telemetry.metrics_reads import version_window

    settings.ALLOW_FAULT_INJECTION = True
    settings.FAULTS = "demo-chat:v1=delay_ms:30"
    runtime = await get_runtime()
    assert await runtime.wait_ready()
    acme = await sync_to_async(make_tenant)("acme")
    started = datetime.now(tz=UTC) - timedelta(seconds=5)
    response = await _infer(acme, max_tokens=4)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    await runtime.replicas[("demo-chat", "v1")].flush_metrics()
    window = await sync_to_async(version_window)(
        model_name="demo-chat", version="v1", start=started, end=datetime.now(tz=UTC) + timedelta(seconds=5)
    )
    assert window.model_time.quantile(0.0) >= 0.030
    assert window.p50_tpot_s >= 0.030
    assert window.num_errors == 0
    # The delay is part of every step, so of a step's base too: the autoscaler reads a slow model as
    # slow, not as loaded.
    beat = runtime.replicas[("demo-chat", "v1")].heartbeat()
    assert beat.base_step_s >= 0.030 and beat.step_s >= 0.030


@pytest.mark.django_db(transaction=True)
async def test_a_replica_with_refused_faults_fails_to_start_and_says_why(registered_model, settings) -> None:
    from asgiref.sync import sync_to_async

    from registry.selectors import version_ref
    from serving.replica.replica import Replica
    from serving.transport.protocol import ReplicaState

    settings.DEBUG = False
    settings.ALLOW_FAULT_INJECTION = False
    ref = await sync_to_async(version_ref)(model_name="demo-chat", version="v1")
    replica = Replica(ref, layer=None, faults=Faults(error_rate=0.5))
    await replica.start()
    assert replica.state is ReplicaState.FAILED
    assert "fault injection is refused" in (replica.error or "")
    await replica.stop()
