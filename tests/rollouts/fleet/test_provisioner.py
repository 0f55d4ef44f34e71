"""The local provisioner's reconciling, with stand-in processes (the real ones: tests/e2e/
test_redis_fleet.py starts run_provisioner over real replica processes)."""

from __future__ import annotations

import itertools
import signal
import sys
from dataclasses import dataclass, field

import pytest

from rollouts.fleet.provisioner import LocalProvisioner


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
    first, embed, second, third = machine.started  # each version's first replica first
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


@pytest.mark.django_db
def test_an_adapter_with_traffic_wants_its_bases_replica_not_one_of_its_own(make_model) -> None:
    """docs/architecture.md, "Adapters on a shared base": run_replica refuses an adapter version, so a
    provisioner asked for one would fail for ever while the base it runs on had none."""
    from registry.models import ModelVersion
    from rollouts.selectors import wanted_replicas

    make_model("chat", versions=("v1", "v2"))  # v2 takes no traffic of its own
    make_model("tune", versions=("v1",))
    base = ModelVersion.objects.get(model__name="chat", version="v2")
    ModelVersion.objects.filter(model__name="tune").update(adapter_of=base)  # rows, not a registration
    assert wanted_replicas() == {("chat", "v1"): 1, ("chat", "v2"): 1}


def test_a_replica_that_keeps_dying_young_waits_longer_each_time() -> None:
    machine = Machine()
    provisioner = machine.provisioner(restart_delay_s=5.0, max_restart_delay_s=15.0)
    restarts = []
    for _ in range(80):  # 80 s, a pass a second; every replica dies within its first second
        provisioner.reconcile({("chat", "v1"): 1})
        for process in machine.started:
            process.returncode = 1 if process.returncode is None else process.returncode
        if len(machine.started) > len(restarts):
            restarts.append(machine.now)
        machine.now += 1.0
    gaps = [b - a for a, b in itertools.pairwise(restarts)]
    assert gaps[:4] == [6.0, 11.0, 16.0, 16.0]  # 5, 10, then capped at 15 s (plus the pass it died in)


def test_a_replica_stuck_draining_is_killed_after_the_timeout() -> None:
    machine = Machine()
    provisioner = machine.provisioner(drain_timeout_s=30.0)
    provisioner.reconcile({("chat", "v1"): 1})
    provisioner.reconcile({})
    (process,) = machine.started
    process.wait = lambda timeout=None: 0  # type: ignore[method-assign]  # never exits on SIGTERM
    machine.now = 20.0
    provisioner.reconcile({})
    assert process.signals == [signal.SIGTERM]
    machine.now = 31.0
    provisioner.reconcile({})
    assert process.signals == [signal.SIGTERM, signal.SIGKILL]


def test_every_version_gets_its_first_gpu_before_any_gets_a_second() -> None:
    machine = Machine()
    provisioner = machine.provisioner(devices=("cuda:0", "cuda:1"))
    provisioner.reconcile({("big", "v1"): 2, ("canary", "v2"): 1})
    assert sorted((p.model, p.device) for p in machine.started) == [("big", "cuda:0"), ("canary", "cuda:1")]


def test_a_version_without_a_replica_gets_a_device_drained_from_another_versions_extra() -> None:
    machine = Machine()
    provisioner = machine.provisioner(devices=("cuda:0", "cuda:1"))
    provisioner.reconcile({("big", "v1"): 2})
    first, second = machine.started
    machine.now = 10.0
    provisioner.reconcile({("big", "v1"): 2, ("canary", "v2"): 1})  # every device taken
    assert second.signals == [signal.SIGTERM] and first.signals == []  # the newest extra makes room
    assert len(machine.started) == 2  # not before it has gone: it still holds its device
    second.returncode = 0
    provisioner.reconcile({("big", "v1"): 2, ("canary", "v2"): 1})
    assert (machine.started[2].model, machine.started[2].device) == ("canary", "cuda:1")
    provisioner.reconcile({("big", "v1"): 2, ("canary", "v2"): 1})
    assert len(machine.started) == 3  # big stays at one until a device frees: no ping-pong


def test_the_back_off_starts_over_once_a_replica_has_stayed_up() -> None:
    machine = Machine()
    provisioner = machine.provisioner(restart_delay_s=5.0)
    provisioner.reconcile({("chat", "v1"): 1})
    machine.started[-1].returncode = 1
    machine.now = 1.0
    provisioner.reconcile({("chat", "v1"): 1})  # died young: 5 s
    machine.now = 6.0
    provisioner.reconcile({("chat", "v1"): 1})  # restarted; it stays up past a minute
    machine.now = 70.0
    provisioner.reconcile({("chat", "v1"): 1})
    machine.started[-1].returncode = 1
    machine.now = 71.0
    provisioner.reconcile({("chat", "v1"): 1})
    machine.now = 76.0
    provisioner.reconcile({("chat", "v1"): 1})
    assert len(machine.started) == 3  # 5 s again, not 10: loading had worked


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_replica_is_signalled_when_its_provisioner_dies_however_it_dies() -> None:
    """A stand-in provisioner process starts a child the way run_replica_launcher does, and is killed
    with SIGKILL (no handler runs): the child gets SIGTERM from the kernel and ends."""
    import os
    import select
    import subprocess

    from tests.conftest import REPO_ROOT

    code = (
        "import subprocess, sys, time\n"
        "from rollouts.fleet.provisioner import _drain_with_parent_hook\n"
        "child = subprocess.Popen(['sleep', '600'], preexec_fn=_drain_with_parent_hook())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    child = os.pidfd_open(child_pid)  # readable once the child has exited
    try:
        parent.kill()
        parent.wait()
        readable, _, _ = select.select([child], [], [], 10.0)
        if not readable:
            os.kill(child_pid, signal.SIGKILL)
            pytest.fail("the child outlived its provisioner")
    finally:
        os.close(child)
