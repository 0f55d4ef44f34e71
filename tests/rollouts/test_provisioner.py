"""The local provisioner's reconciling, with stand-in processes (the real ones: tests/e2e/
test_redis_fleet.py starts run_provisioner over real replica processes)."""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field

import pytest

from rollouts.provisioner import LocalProvisioner


@dataclass
class FakeProcess:
    pid: int
    model: str
    version: str
    device: str
    returncode: int | None = None
    signals: list[int] = field(default_factory=list)

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:  # a stand-in drains at once when told to
            self.returncode = 0 if signal.SIGTERM in self.signals else -9
        return self.returncode


@dataclass
class Machine:
    """The launcher and a clock the test moves."""

    now: float = 0.0
    started: list[FakeProcess] = field(default_factory=list)
    _pids: itertools.count = field(default_factory=lambda: itertools.count(100))

    def launch(self, model: str, version: str, device: str) -> FakeProcess:
        process = FakeProcess(next(self._pids), model, version, device)
        self.started.append(process)
        return process

    def provisioner(self, **options: object) -> LocalProvisioner:
        return LocalProvisioner(self.launch, clock=lambda: self.now, **options)  # type: ignore[arg-type]

    def running(self) -> list[tuple[str, str]]:
        return sorted((p.model, p.version) for p in self.started if p.returncode is None and not p.signals)


def test_it_starts_what_is_missing_and_drains_the_newest_of_what_is_over() -> None:
    machine = Machine()
    provisioner = machine.provisioner()
    provisioner.reconcile({("chat", "v1"): 2, ("embed", "v1"): 1})
    assert machine.running() == [("chat", "v1"), ("chat", "v1"), ("embed", "v1")]
    provisioner.reconcile({("chat", "v1"): 2, ("embed", "v1"): 1})
    assert len(machine.started) == 3  # met: nothing more

    machine.now = 10.0
    provisioner.reconcile({("chat", "v1"): 3})  # embed lost its target: it drains
    first, second, embed, third = machine.started
    assert embed.signals == [signal.SIGTERM] and third.model == "chat"
    machine.now = 20.0
    provisioner.reconcile({("chat", "v1"): 1})
    assert (first.signals, second.signals, third.signals) == ([], [signal.SIGTERM], [signal.SIGTERM])
    assert machine.running() == [("chat", "v1")]
    # the drained ones exit; they are forgotten, and nothing is started in their place
    for process in (second, third, embed):
        process.returncode = 0
    provisioner.reconcile({("chat", "v1"): 1})
    assert provisioner.stopping == [] and len(machine.started) == 4


def test_a_replica_that_dies_is_restarted_after_the_delay_not_before() -> None:
    machine = Machine()
    provisioner = machine.provisioner(restart_delay_s=5.0)
    provisioner.reconcile({("chat", "v1"): 1})
    machine.started[0].returncode = 1  # could not load, say
    machine.now = 1.0
    provisioner.reconcile({("chat", "v1"): 1})
    assert len(machine.started) == 1
    machine.now = 6.0
    provisioner.reconcile({("chat", "v1"): 1})
    assert len(machine.started) == 2 and machine.running() == [("chat", "v1")]


def test_each_gpu_replica_gets_a_device_of_its_own_and_a_draining_one_keeps_it() -> None:
    machine = Machine()
    provisioner = machine.provisioner(devices=("cuda:0", "cuda:1"))
    provisioner.reconcile({("chat", "v1"): 3})
    assert [p.device for p in machine.started] == ["cuda:0", "cuda:1"]  # no third device: it waits
    provisioner.reconcile({("chat", "v1"): 1, ("embed", "v1"): 1})
    assert len(machine.started) == 2  # cuda:1 drains; until it exits, embed waits for it
    machine.started[1].returncode = 0
    provisioner.reconcile({("chat", "v1"): 1, ("embed", "v1"): 1})
    assert (machine.started[2].model, machine.started[2].device) == ("embed", "cuda:1")


def test_only_its_own_models_and_shutdown_drains_everything() -> None:
    machine = Machine()
    provisioner = machine.provisioner(models=frozenset({"chat"}))
    provisioner.reconcile({("chat", "v1"): 2, ("embed", "v1"): 1})
    assert machine.running() == [("chat", "v1"), ("chat", "v1")]
    provisioner.shutdown(timeout_s=1.0)
    assert all(p.signals == [signal.SIGTERM] and p.returncode == 0 for p in machine.started)
    assert provisioner.serving == {} and provisioner.stopping == []


@pytest.mark.django_db
def test_wanted_replicas_are_the_targets_and_one_for_a_serving_version_without_a_target(make_model) -> None:
    from registry.models import ModelVersion
    from rollouts.models import ScaleTarget
    from rollouts.selectors import wanted_replicas

    make_model("chat")
    make_model("embed", versions=("v1", "v2"))
    ScaleTarget.objects.create(version=ModelVersion.objects.get(model__name="chat", version="v1"), replicas=3)
    ScaleTarget.objects.create(version=ModelVersion.objects.get(model__name="chat", version="v2"), replicas=0)
    assert wanted_replicas() == {("chat", "v1"): 3, ("chat", "v2"): 0, ("embed", "v1"): 1}
