"""Operators' commands of the rollouts app."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from audit import actors

pytestmark = pytest.mark.django_db


def _run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_set_alias_moves_it_logs_the_move_and_bumps_the_routing_revision(make_model: Any) -> None:
    from registry.models import AliasEvent
    from tests.rollouts.conftest import routing_state

    model = make_model("chat")
    revision, _, aliases = routing_state(model)
    assert aliases["stable"] == "v1"
    assert (
        _run("set_alias", "chat", "stable", "v2", "--reason", "v1 misbehaves").strip() == "chat@stable -> v2"
    )
    new_revision, _, aliases = routing_state(model)
    assert aliases["stable"] == "v2" and new_revision > revision  # gateways revalidate on the revision
    event = AliasEvent.objects.filter(alias__name="stable").latest("id")
    assert (event.from_version.version, event.to_version.version, event.actor, event.reason) == (
        "v1",
        "v2",
        actors.command("set_alias"),
        "v1 misbehaves",
    )
    _run("set_alias", "chat", "eval", "v3")
    assert routing_state(model)[2] == {"stable": "v2", "eval": "v3"}


def test_set_alias_refuses_unknown_names_and_the_canary_alias_of_a_deployment_in_flight(
    make_model: Any,
) -> None:
    from rollouts.services import deployment_create

    make_model("chat")
    with pytest.raises(CommandError, match="unknown model"):
        _run("set_alias", "nope", "stable", "v1")
    with pytest.raises(CommandError, match="unknown version"):
        _run("set_alias", "chat", "stable", "v9")
    with pytest.raises(CommandError, match="invalid alias name"):
        _run("set_alias", "chat", "Bad Name!", "v1")
    from registry.models import Model

    deployment_create(model=Model.objects.get(name="chat"), version="v2", created_by="test")
    with pytest.raises(CommandError, match="deployment in flight"):
        _run("set_alias", "chat", "canary", "v3")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--kubernetes",), "needs --image"),
        (("--kubernetes", "--image", "x", "--devices", "cuda:0"), "--devices is for local processes"),
        (("--image", "x"), "--image and --namespace are for --kubernetes"),
        (("--interval", "0"), "--interval must be above 0"),
        (("--devices", "tpu:0"), "--devices takes"),
        (("--kubernetes", "--image", "x"), "not in a Kubernetes pod"),  # no service account here
    ],
)
def test_run_provisioner_refuses_options_of_the_other_mode_and_bad_values(
    settings: Any, args: tuple[str, ...], message: str
) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:6379/15"  # never reached: each refusal comes first
    with pytest.raises(CommandError, match=message):
        _run("run_provisioner", *args)


def test_set_scaling_bounds_a_models_versions_and_clear_goes_back_to_the_defaults(
    make_model: Any, settings: Any
) -> None:
    from rollouts.fleet.autoscaler import ScalingPolicy
    from rollouts.scaling import autoscale
    from rollouts.selectors import wanted_replicas
    from tests.rollouts.fleet.test_autoscaler import beat

    make_model("chat")
    make_model("embed", versions=("v1",))
    settings.AUTOSCALER = {**settings.AUTOSCALER, "min_replicas": 1, "max_replicas": 4}
    assert (
        _run("set_scaling", "chat", "--min", "2", "--max", "8").strip()
        == "chat: 2 to 8 replicas per serving version"
    )
    assert wanted_replicas() == {("chat", "v1"): 2, ("embed", "v1"): 1}  # before any tick: the model's floor
    flood = [beat("chat", "v1", waiting=40, sent_at=1000.0), beat("embed", "v1", waiting=40, sent_at=1000.0)]
    policy = ScalingPolicy(**settings.AUTOSCALER)
    assert autoscale(heartbeats=flood, policy=policy, now=1000.0) == {("chat", "v1"): 8, ("embed", "v1"): 4}
    _run("set_scaling", "chat", "--max", "3")  # the other bound stays
    assert autoscale(heartbeats=flood, policy=policy, now=1001.0) == {("chat", "v1"): 3}
    with pytest.raises(CommandError, match="min 5, max 3"):
        _run("set_scaling", "chat", "--min", "5")
    with pytest.raises(CommandError, match="max >= 1"):
        _run("set_scaling", "chat", "--min", "0", "--max", "0")
    _run("set_scaling", "chat", "--clear")
    assert autoscale(heartbeats=flood, policy=policy, now=1002.0) == {("chat", "v1"): 4}


def test_set_scaling_to_zero_tells_every_gateway_through_the_routing_revision(make_model: Any) -> None:
    from registry.selectors import routing_snapshot

    make_model("chat")
    before = routing_snapshot(model_name="chat")
    assert before is not None and not before.scales_to_zero
    out = _run("set_scaling", "chat", "--min", "0", "--max", "2")
    assert "chat: 0 to 2 replicas per serving version" in out and "no request for 300 s scales to zero" in out
    after = routing_snapshot(model_name="chat")
    assert after is not None and after.scales_to_zero and after.revision > before.revision
    _run("set_scaling", "chat", "--clear")
    cleared = routing_snapshot(model_name="chat")
    assert cleared is not None and not cleared.scales_to_zero and cleared.revision > after.revision
