"""The deployment state machine through its services, with the metrics store faked."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from registry.models import AliasEvent, ModelVersion
from registry.selectors import routing_snapshot, versions_with_traffic
from rollouts import judge_tick, selectors, services, transitions
from rollouts.judge import VerdictKind
from rollouts.models import Deployment, DeploymentEvent
from rollouts.steps import DeploymentConflict
from tests.rollouts.conftest import FakeMetrics, routing_state, window

pytestmark = pytest.mark.django_db

State = Deployment.State
T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def create(model, **kwargs) -> Deployment:  # type: ignore[no-untyped-def]
    values = {
        "version": "v2",
        "created_by": "staff:alice",
        "steps": [{"pct": 5}, {"pct": 50}, {"pct": 100}],
        "bake_seconds": 60,
    }
    values.update(kwargs)
    return services.deployment_create(model=model, **values)


def events(deployment: Deployment) -> list[tuple[str, str, str]]:
    return list(deployment.events.order_by("at", "id").values_list("from_state", "to_state", "actor"))


def tick(deployment: Deployment, seconds: float, metrics: FakeMetrics):  # type: ignore[no-untyped-def]
    verdict = judge_tick.deployment_judge(deployment=deployment, now=at(seconds), read_window=metrics)
    deployment.refresh_from_db()
    return verdict


@pytest.fixture
def ramping(make_model):  # type: ignore[no-untyped-def]
    """chat: v1 stable at 100%, a deployment of v2 ramping at its first step (5%) since T0."""
    model = make_model()
    deployment = create(model)
    tick(deployment, 0, FakeMetrics())
    assert deployment.state == State.RAMPING
    return model, deployment


def test_create_records_pending_then_provisions_with_the_canary_alias_and_no_traffic(make_model) -> None:
    model = make_model()
    revision_before, weights_before, _ = routing_state(model)

    deployment = create(model)

    assert deployment.state == State.PROVISIONING
    assert deployment.incumbent.version == "v1"
    assert deployment.thresholds["alpha"] == 0.01  # defaults resolved at creation
    assert events(deployment) == [("", "pending", "staff:alice"), ("pending", "provisioning", "staff:alice")]
    revision, weights, aliases = routing_state(model)
    assert weights == weights_before == {"v1": 100}
    assert aliases == {"stable": "v1", "canary": "v2"}
    assert revision == revision_before + 1  # the alias move bumps the revision
    # The supervisor now wants a replica for v2 although it takes no traffic.
    assert {ref.version for ref in versions_with_traffic()} == {"v1", "v2"}
    assert AliasEvent.objects.filter(alias__name="canary", to_version__version="v2").count() == 1


def test_provisioning_ends_on_the_next_tick_with_the_first_step_of_traffic(make_model) -> None:
    model = make_model()
    deployment = create(model)
    revision_before = routing_state(model)[0]

    assert tick(deployment, 0, FakeMetrics()) is None

    assert deployment.state == State.RAMPING
    assert deployment.current_step == 0
    assert deployment.step_started_at == T0
    revision, weights, _ = routing_state(model)
    assert weights == {"v2": 5, "v1": 95}
    assert revision == revision_before + 1
    last = deployment.events.last()
    assert (last.from_state, last.to_state, last.actor) == ("provisioning", "ramping", "rollout-judge")
    assert last.figures["routing_revision"] == revision


def test_readiness_hook_keeps_a_deployment_provisioning_and_times_it_out(make_model, settings) -> None:
    settings.ROLLOUT_READINESS_CHECK = "tests.rollouts.test_services.never_ready"
    settings.ROLLOUT_PROVISION_TIMEOUT_S = 120
    model = make_model()
    deployment = create(model)
    deployment.provisioning_started_at = T0
    deployment.save()

    tick(deployment, 60, FakeMetrics())
    assert deployment.state == State.PROVISIONING
    tick(deployment, 121, FakeMetrics())

    assert deployment.state == State.ROLLED_BACK
    assert "not ready after 121 s" in deployment.events.get(to_state="rolling_back").reason
    _, weights, aliases = routing_state(model)
    assert weights == {"v1": 100}
    assert aliases == {"stable": "v1", "canary": "v1"}  # the candidate keeps no alias: it drains


def never_ready(deployment: Deployment) -> bool:
    return False


@pytest.mark.parametrize("how", ["the provisioning timeout", "the API"])
def test_rolling_back_before_the_first_step_leaves_the_operators_split_as_it_was(
    make_model, settings, how
) -> None:
    """v1 stable with 80%, v3 kept at 20% by hand: a canary of v2 that never became ready took no traffic,
    and its rollback had routed everything to v1, so v3's share vanished (and the autoscaler then took
    its replicas)."""
    from registry.services import routing_table_set

    settings.ROLLOUT_READINESS_CHECK = "tests.rollouts.test_services.never_ready"
    settings.ROLLOUT_PROVISION_TIMEOUT_S = 120
    model = make_model()
    routing_table_set(model=model, weights={"v1": 80, "v3": 20})
    deployment = create(model)
    deployment.provisioning_started_at = T0
    deployment.save()
    tick(deployment, 60, FakeMetrics())
    assert deployment.state == State.PROVISIONING
    if how == "the API":
        services.deployment_rollback(deployment=deployment, actor="staff:alice")
        deployment.refresh_from_db()
    else:
        tick(deployment, 121, FakeMetrics())
    assert deployment.state == State.ROLLED_BACK
    _, weights, aliases = routing_state(model)
    assert weights == {"v1": 80, "v3": 20}
    assert aliases["stable"] == "v1"
    assert "never ramped" in deployment.events.get(to_state="rolled_back").reason


def test_before_the_first_step_a_share_given_to_the_candidate_by_hand_goes_to_the_incumbent(
    make_model, settings
) -> None:
    """set_traffic gave v2 10% before its canary: rolled back unready, v2 kept it with no replica (503s)."""
    from registry.services import routing_table_set

    settings.ROLLOUT_READINESS_CHECK = "tests.rollouts.test_services.never_ready"
    model = make_model()
    routing_table_set(model=model, weights={"v1": 70, "v2": 10, "v3": 20})
    deployment = create(model)
    services.deployment_rollback(deployment=deployment, actor="staff:alice")
    _, weights, _ = routing_state(model)
    assert weights == {"v1": 80, "v3": 20}
    reason = Deployment.objects.get(pk=deployment.pk).events.get(to_state="rolled_back").reason
    assert "the candidate's 10% (not the deployment's) to v1, the rest as it was" in reason


def test_the_judge_holds_while_healthy_then_advances_after_the_bake_window(ramping) -> None:
    model, deployment = ramping
    metrics = FakeMetrics({"v2": window(num_requests=80), "v1": window(num_requests=1500)})
    num_events = deployment.events.count()

    verdict = tick(deployment, 30, metrics)
    assert verdict.kind is VerdictKind.HOLD
    assert deployment.events.count() == num_events  # a hold is not a transition
    assert deployment.last_verdict["verdict"] == "hold"
    # The windows are the same interval for both versions: [step start, now).
    assert metrics.calls == [("chat", "v2", T0, at(30)), ("chat", "v1", T0, at(30))]

    verdict = tick(deployment, 60, metrics)
    assert verdict.kind is VerdictKind.ADVANCE
    assert deployment.current_step == 1
    assert deployment.step_started_at == at(60)
    assert routing_state(model)[1] == {"v2": 50, "v1": 50}
    event = deployment.events.last()
    assert event.to_state == "ramping"
    assert "5% -> 50%" in event.reason
    assert event.figures["canary"]["num_requests"] == 80
    assert event.figures["routing"] == {"v2": 50, "v1": 50}


def test_advancing_into_100pct_promotes_and_moves_the_stable_alias_with_a_log(ramping) -> None:
    model, deployment = ramping
    metrics = FakeMetrics({"v2": window(), "v1": window()})
    tick(deployment, 60, metrics)
    tick(deployment, 120, metrics)

    assert deployment.state == State.PROMOTED
    assert deployment.current_pct == 100
    assert deployment.finished_at == at(120)
    _, weights, aliases = routing_state(model)
    assert weights == {"v2": 100}
    assert aliases["stable"] == "v2"
    move = AliasEvent.objects.filter(alias__name="stable").last()
    assert (move.from_version.version, move.to_version.version, move.actor) == ("v1", "v2", "rollout-judge")
    assert "promoted" in move.reason
    # The old version has no traffic and no alias left, so its replicas drain.
    assert {ref.version for ref in versions_with_traffic()} == {"v2"}
    assert [e[1] for e in events(deployment)] == ["pending", "provisioning", "ramping", "ramping", "promoted"]


def test_a_slow_canary_is_rolled_back_by_the_judge_at_once(
    ramping, django_capture_on_commit_callbacks
) -> None:
    model, deployment = ramping
    revision_before = routing_state(model)[0]
    metrics = FakeMetrics(
        {"v2": window(num_requests=60, tpot_p99_ms=250.0), "v1": window(num_requests=1200, tpot_p99_ms=90.0)}
    )

    with django_capture_on_commit_callbacks(execute=True):
        verdict = tick(deployment, 10, metrics)

    deployment.refresh_from_db()
    assert verdict.kind is VerdictKind.ROLLBACK
    assert deployment.state == State.ROLLED_BACK
    revision, weights, aliases = routing_state(model)
    assert weights == {"v1": 100}
    assert revision > revision_before
    assert aliases == {"stable": "v1", "canary": "v1"}
    decision, done = deployment.events.filter(to_state__in=["rolling_back", "rolled_back"]).order_by("id")
    assert decision.actor == "rollout-judge"
    assert "p99 TPOT 250.0 ms > limit 112.5 ms" in decision.reason
    assert decision.figures["canary"]["tpot_p99_ms"] == 250.0
    assert decision.figures["incumbent"]["tpot_p99_ms"] == 90.0
    assert done.figures["routing"] == {"v1": 100}
    assert done.figures["routing_revision"] == revision
    assert deployment.rollback_decided_at == at(10)
    assert deployment.rollback_edit_ms is not None and deployment.rollback_edit_ms >= 0
    assert deployment.rollback_committed_at is not None
    assert {ref.version for ref in versions_with_traffic()} == {"v1"}


def test_unreadable_metrics_hold_the_deployment_as_is(ramping) -> None:
    model, deployment = ramping

    def broken(**kwargs):  # type: ignore[no-untyped-def]
        raise ConnectionError("metrics store down")

    verdict = judge_tick.deployment_judge(deployment=deployment, now=at(600), read_window=broken)
    deployment.refresh_from_db()
    assert verdict.kind is VerdictKind.INSUFFICIENT_DATA
    assert "metrics unavailable" in verdict.reason
    assert deployment.state == State.RAMPING
    assert routing_state(model)[1] == {"v2": 5, "v1": 95}


def test_a_step_held_past_its_bake_window_is_written_down_once_with_the_reason(ramping) -> None:
    """Within the bake window a hold is routine and writes nothing; past it the step is overdue, and the
    deployment's history says why (once per step, not once per tick), so an operator reading it sees
    what the canary is waiting for."""
    model, deployment = ramping
    too_few = FakeMetrics({"v2": window(num_requests=3), "v1": window(num_requests=1500)})
    num_events = deployment.events.count()

    assert tick(deployment, 30, too_few).kind is VerdictKind.INSUFFICIENT_DATA
    assert deployment.events.count() == num_events

    for seconds in (60, 90, 120):
        assert tick(deployment, seconds, too_few).kind is VerdictKind.INSUFFICIENT_DATA
    overdue = list(deployment.events.all()[num_events:])
    assert [(e.from_state, e.to_state, e.at) for e in overdue] == [("ramping", "ramping", at(60))]
    assert "held past its 60 s bake window" in overdue[0].reason
    assert "3 of" in overdue[0].reason  # the judge's own words: too few canary requests
    assert overdue[0].figures["bake_elapsed_s"] == 60
    assert routing_state(model)[1] == {"v2": 5, "v1": 95}  # nothing else moved

    # The next step gets its own record when it, too, runs over.
    healthy = FakeMetrics({"v2": window(num_requests=80), "v1": window(num_requests=1500)})
    assert tick(deployment, 150, healthy).kind is VerdictKind.ADVANCE
    tick(deployment, 240, too_few)
    assert deployment.events.last().reason.startswith("judge: step 2/3 (50%) held past")


def test_manual_rollback_and_promote_and_refusals_after_the_end(ramping) -> None:
    model, deployment = ramping
    services.deployment_rollback(deployment=deployment, actor="staff:bob", reason="pager went off")
    deployment.refresh_from_db()
    assert deployment.state == State.ROLLED_BACK
    assert routing_state(model)[1] == {"v1": 100}
    assert deployment.events.get(to_state="rolling_back").reason == "pager went off"
    with pytest.raises(DeploymentConflict, match="rolled_back"):
        services.deployment_rollback(deployment=deployment, actor="staff:bob")
    with pytest.raises(DeploymentConflict):
        services.deployment_promote(deployment=deployment, actor="staff:bob")

    second = create(model, version="v3")
    tick(second, 0, FakeMetrics())  # ready: ramping, so it may be promoted
    services.deployment_promote(deployment=second, actor="staff:bob")
    second.refresh_from_db()
    assert second.state == State.PROMOTED
    _, weights, aliases = routing_state(model)
    assert weights == {"v3": 100}
    assert aliases["stable"] == "v3"
    assert AliasEvent.objects.filter(alias__name="stable").last().actor == "staff:bob"


def test_a_second_deployment_in_flight_is_a_conflict_and_writes_nothing(ramping) -> None:
    model, _ = ramping
    before = (Deployment.objects.count(), DeploymentEvent.objects.count(), AliasEvent.objects.count())
    with pytest.raises(DeploymentConflict, match="already has deployment"):
        create(model, version="v3")
    after = (Deployment.objects.count(), DeploymentEvent.objects.count(), AliasEvent.objects.count())
    assert after == before


def test_the_database_refuses_two_in_flight_deployments_even_past_the_check(ramping) -> None:
    from django.db import IntegrityError, transaction

    model, deployment = ramping
    with pytest.raises(IntegrityError), transaction.atomic():
        Deployment.objects.create(
            model=model,
            candidate=ModelVersion.objects.get(model=model, version="v3"),
            incumbent=deployment.incumbent,
            steps=[{"pct": 100}],
            bake_seconds=0,
            thresholds={},
            state=State.PENDING,
            created_by="x",
        )


def test_shadow_deployments_never_move_traffic(make_model) -> None:
    model = make_model()
    deployment = create(model, strategy="shadow", steps=None, mirror_pct=20)
    metrics = FakeMetrics({"v2": window(num_shadow_compared=40, num_shadow_matched=38), "v1": window()})
    tick(deployment, 0, metrics)
    assert deployment.state == State.SHADOWING
    assert routing_snapshot(model_name="chat").mirror == ("v2", 20)
    tick(deployment, 60, metrics)
    assert deployment.state == State.COMPLETED
    assert deployment.last_verdict["figures"]["output_match"] == {"compared": 40, "matched": 38, "rate": 0.95}
    _, weights, aliases = routing_state(model)
    assert weights == {"v1": 100}
    assert aliases == {"stable": "v1", "canary": "v1"}
    assert routing_snapshot(model_name="chat").mirror is None


@pytest.mark.parametrize("end", ["rollback", "promote"])
def test_ending_a_shadow_deployment_by_hand_stops_the_mirroring(make_model, end) -> None:
    model = make_model()
    deployment = create(model, strategy="shadow", steps=None, mirror_pct=50)
    tick(deployment, 0, FakeMetrics({"v2": window(), "v1": window()}))
    revision = routing_snapshot(model_name="chat").revision
    getattr(services, f"deployment_{end}")(deployment=deployment, actor="staff:bob")
    snapshot = routing_snapshot(model_name="chat")
    assert snapshot.mirror is None
    assert snapshot.revision > revision  # gateways see the change at their next revalidation


def test_version_states_report_the_latest_deployment_and_rollbacks(ramping) -> None:
    model, deployment = ramping
    assert selectors.version_states(model=model) == {"v2": "ramping", "v1": "incumbent"}
    services.deployment_rollback(deployment=deployment, actor="staff:bob")
    second = create(model, version="v3")
    tick(second, 0, FakeMetrics())
    services.deployment_promote(deployment=second, actor="staff:bob")
    assert selectors.version_states(model=model) == {"v3": "promoted", "v2": "rolled_back"}


def test_a_version_deployed_again_after_its_rollback_no_longer_reads_rolled_back(ramping) -> None:
    model, deployment = ramping
    services.deployment_rollback(deployment=deployment, actor="staff:bob")
    again = create(model)  # v2, fixed
    tick(again, 0, FakeMetrics())
    services.deployment_promote(deployment=again, actor="staff:bob")
    third = create(model, version="v3")
    tick(third, 0, FakeMetrics())
    assert selectors.version_states(model=model) == {"v3": "ramping", "v2": "incumbent"}
    services.deployment_promote(deployment=third, actor="staff:bob")
    # v2's own latest deployment was promoted and is no longer the model's latest: the registry's state.
    assert selectors.version_states(model=model) == {"v3": "promoted"}


def test_detail_lists_events_with_reasons_and_figures(ramping) -> None:
    _, deployment = ramping
    detail = selectors.deployment_detail(deployment=selectors.deployment_get(deployment_id=deployment.pk))
    assert detail["state"] == "ramping"
    assert detail["current_step"] == 0
    assert detail["current_pct"] == 5
    assert detail["steps"] == [{"pct": 5}, {"pct": 50}, {"pct": 100}]
    assert [e["to_state"] for e in detail["events"]] == ["pending", "provisioning", "ramping"]
    assert detail["events"][-1]["figures"]["routing"] == {"v2": 5, "v1": 95}
    assert timezone.is_aware(detail["created_at"])


def test_the_judge_reads_the_real_metrics_store_through_its_selector(ramping) -> None:
    """The default reader (settings.ROLLOUT_WINDOW_READER) is the store's
    serving.telemetry.metrics_reads.version_window:
    replicas' samples flushed to the store come out as the judge's windows, p99s in ms."""
    import time

    from serving.telemetry.recorder import MetricsRecorder, RequestSample

    model, deployment = ramping
    bucket = (int(time.time()) // 5 + 1) * 5  # a whole 5 s row after the step started
    step_start = dt.datetime.fromtimestamp(bucket, dt.UTC)
    Deployment.objects.filter(pk=deployment.pk).update(step_started_at=step_start)
    for version, num, tpot_s in (("v1", 400, 0.09), ("v2", 60, 0.25)):
        recorder = MetricsRecorder(
            model_name="chat",
            version=version,
            version_id=ModelVersion.objects.get(model=model, version=version).pk,
            replica_id=f"replica-{version}",
        )
        sample = RequestSample("stop", num_prompt_tokens=5, num_output_tokens=40, ttft_s=0.1, tpot_s=tpot_s)
        recorder.record(requests=[sample] * num, now=bucket + 1)
        recorder.record(requests=[RequestSample("error", error_type="boom")], now=bucket + 2)
        recorder.record(requests=[RequestSample("length", num_output_tokens=64)] * 3, now=bucket + 3)
        assert recorder.flush() == 1

    verdict = judge_tick.deployment_judge(deployment=deployment, now=step_start + dt.timedelta(seconds=10))

    assert verdict.kind is VerdictKind.ROLLBACK
    canary, incumbent = verdict.figures["canary"], verdict.figures["incumbent"]
    assert (canary["num_requests"], canary["num_errors"], canary["num_truncated"]) == (64, 1, 3)
    assert (incumbent["num_requests"], incumbent["num_errors"], incumbent["num_truncated"]) == (404, 1, 3)
    assert canary["tpot_p99_ms"] == pytest.approx(250.0, rel=0.01)
    assert incumbent["tpot_p99_ms"] == pytest.approx(90.0, rel=0.01)
    assert canary["mean_output_tokens"] == pytest.approx((60 * 40 + 3 * 64) / 63, abs=1e-3)
    assert "p99 TPOT" in verdict.reason


@pytest.mark.django_db(transaction=True)
def test_a_judge_tick_holding_its_deployment_does_not_hold_back_metrics_flushes(make_model) -> None:
    """The tick locks its deployment's row for the whole tick; the versions' rows it joins are not
    locked with it, or each replica's flush (whose rows reference the version) would wait the tick out."""
    import threading
    from datetime import UTC, datetime

    from django.db import connection, transaction

    from rollouts import services as rollout_services
    from serving.telemetry.metric_window import MetricsWindow
    from serving.telemetry.metrics_store import metrics_flush

    if connection.vendor != "postgresql":
        pytest.skip("SQLite's transactions take the whole database's write lock (the Postgres pass)")
    model = make_model("chat")
    deployment = rollout_services.deployment_create(model=model, version="v2", created_by="t")
    locked, release = threading.Event(), threading.Event()

    def tick() -> None:
        try:
            with transaction.atomic():
                transitions.locked(deployment)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=tick)
    holder.start()
    try:
        assert locked.wait(10)
        window = MetricsWindow()
        window.count("requests")
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # waiting on the tick's lock fails rather than hangs
        start = datetime(2026, 1, 1, tzinfo=UTC)
        written = metrics_flush(version_id=deployment.candidate_id, replica_id="r", windows=[(start, window)])
        assert written == 1
    finally:
        release.set()
        holder.join()
