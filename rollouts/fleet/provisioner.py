"""The provisioner for one machine: runs `manage.py run_replica` processes so that each model version
has as many replicas as its target says (rollouts.selectors.wanted_replicas: the autoscaler's targets).

`manage.py run_provisioner` calls `reconcile` every few seconds. It starts what is missing; it stops what
is over with SIGTERM, on which a replica drains (admits nothing new, finishes what it holds) and exits,
so scaling down loses no request; the newest replica goes first, and one still draining after
`drain_timeout_s` is killed. A replica that exits on its own is started again after `restart_delay_s`,
doubling with each replica of that version that dies young (up to `max_restart_delay_s`), so a version
whose replica cannot load does not spin. With devices given (`cuda:0,cuda:1`), each replica gets a device
of its own, every version's first replica before any version's second, and a version waits when none is
free; `cpu` is shared by any number. Replicas get SIGTERM when the provisioner dies, so none is left
running unsupervised.

Beyond one machine, a Kubernetes Deployment per version with `replicas` set to the same target does
this job (not built here: no cluster to run it against)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (model name, version)


class Process(Protocol):
    """What the provisioner needs of a child (subprocess.Popen has it)."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Launcher = Callable[[str, str, str], Process]  # (model, version, device) -> a started replica process
LIVED_S = 60.0  # a replica that died sooner than this after its start counts toward a longer back-off


def run_replica_launcher(manage_py: Path, *, extra_args: Sequence[str] = ()) -> Launcher:
    """Starts `python manage.py run_replica` with this process's environment (database, Redis)."""

    drain_with_parent = _drain_with_parent_hook()

    def launch(model: str, version: str, device: str) -> Process:
        command = [sys.executable, str(manage_py), "run_replica", "--model", model, "--version", version]
        return subprocess.Popen(
            [*command, "--device", device, *extra_args], cwd=manage_py.parent, preexec_fn=drain_with_parent
        )

    return launch


def _drain_with_parent_hook() -> Callable[[], None] | None:
    """For the child, between fork and exec: ask Linux for SIGTERM (a drain) when the provisioner dies,
    however it dies. Everything is looked up here, in the parent: between fork and exec the child may only
    call what needs no lock. None off Linux."""
    if sys.platform != "linux":
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    pr_set_pdeathsig = 1  # from <sys/prctl.h>

    def hook() -> None:
        if prctl(pr_set_pdeathsig, signal.SIGTERM) != 0 or os.getppid() != parent:
            os._exit(1)  # could not arrange it, or the provisioner is already gone: do not run unwatched

    return hook


@dataclass(slots=True)
class _Child:
    key: Key
    device: str
    process: Process
    started_at: float
    stopped_at: float | None = None  # when it was sent SIGTERM


@dataclass(slots=True)
class LocalProvisioner:
    launch: Launcher
    devices: Sequence[str] = ("cpu",)
    models: frozenset[str] | None = None  # only these models' versions; None: every model
    restart_delay_s: float = 5.0
    max_restart_delay_s: float = 300.0
    drain_timeout_s: float = 600.0
    clock: Callable[[], float] = time.monotonic
    serving: dict[Key, list[_Child]] = field(default_factory=dict)
    stopping: list[_Child] = field(default_factory=list)  # sent SIGTERM, draining
    _restart_at: dict[Key, float] = field(default_factory=dict)  # not before then, after a death
    _young_deaths: dict[Key, int] = field(default_factory=dict)  # in a row, each within LIVED_S of its start

    def reconcile(self, targets: Mapping[Key, int]) -> None:
        """One pass: reap the children that exited, then start or stop replicas to meet the targets (a
        version without a target, or of a model this provisioner does not serve, wants none)."""
        now = self.clock()
        self._reap(now)
        wanted = {k: n for k, n in targets.items() if self.models is None or k[0] in self.models}
        for key in sorted(set(self.serving) | set(wanted)):
            children = self.serving.setdefault(key, [])
            for child in sorted(children, key=lambda c: c.started_at)[wanted.get(key, 0) :]:
                self._stop(child, now)  # the newest of those over the target
        # Every version's first replica before any version's second: extras never starve a canary of
        # the last free device.
        for rank in range(max(wanted.values(), default=0)):
            for key in sorted(wanted):
                if len(self.serving[key]) == rank < wanted[key] and now >= self._restart_at.get(key, now):
                    self._start(key, now)
        self._make_room_for_first_replicas(wanted, now)
        for key in [k for k, children in self.serving.items() if not children]:
            del self.serving[key]

    def _make_room_for_first_replicas(self, wanted: Mapping[Key, int], now: float) -> None:
        """A version that wants a replica and has none, with every device taken: drain the newest replica
        of a version that has more than one. It starts once that one has gone, on a later pass."""
        if self._free_device() is not None or self.stopping:
            return  # a device is free, or one is being freed already
        if not any(
            n > 0 and not self.serving.get(k) and now >= self._restart_at.get(k, now)
            for k, n in wanted.items()
        ):
            return
        extras = [c for children in self.serving.values() if len(children) > 1 for c in children]
        if extras:
            self._stop(sorted(extras, key=lambda c: c.started_at)[-1], now)  # the newest, as over a target

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop every replica (each drains first) and wait for them to exit; kill what outlives the wait."""
        for children in list(self.serving.values()):
            for child in list(children):
                self._stop(child, self.clock())
        self.serving.clear()
        deadline = self.clock() + timeout_s
        for child in self.stopping:
            try:
                child.process.wait(timeout=max(0.0, deadline - self.clock()))
            except subprocess.TimeoutExpired:
                logger.warning(
                    "provisioner: replica pid %d did not drain in time; killing it", child.process.pid
                )
                child.process.send_signal(signal.SIGKILL)
                child.process.wait()
        self.stopping.clear()

    def _reap(self, now: float) -> None:
        self.stopping = [c for c in self.stopping if c.process.poll() is None]
        for child in self.stopping:
            if child.stopped_at is not None and now - child.stopped_at > self.drain_timeout_s:
                logger.warning("provisioner: replica pid %d still draining; killing it", child.process.pid)
                child.process.send_signal(signal.SIGKILL)
                child.stopped_at = None  # killed once; reaped when it is gone
        for key, children in self.serving.items():
            dead = [c for c in children if c.process.poll() is not None]
            if any(now - c.started_at >= LIVED_S for c in children if c not in dead):
                self._young_deaths[key] = 0  # a replica of it has stayed up: loading works
            if not dead:
                continue
            for child in dead:
                children.remove(child)
                logger.warning(
                    "provisioner: replica of %s:%s (pid %d) exited with %s",
                    *key,
                    child.process.pid,
                    child.process.poll(),
                )
            # Once per pass, however many died in it: the back-off doubles per round of deaths.
            young = any(now - c.started_at < LIVED_S for c in dead)
            self._young_deaths[key] = self._young_deaths.get(key, 0) + 1 if young else 1
            delay = min(self.max_restart_delay_s, self.restart_delay_s * 2 ** (self._young_deaths[key] - 1))
            self._restart_at[key] = now + delay
            logger.warning("provisioner: %s:%s is restarted in %g s", *key, delay)

    def _start(self, key: Key, now: float) -> None:
        device = self._free_device()
        if device is None:
            logger.warning("provisioner: no free device for another replica of %s:%s", *key)
            return
        process = self.launch(key[0], key[1], device)
        self.serving[key].append(_Child(key, device, process, now))
        logger.info("provisioner: started a replica of %s:%s on %s (pid %d)", *key, device, process.pid)

    def _stop(self, child: _Child, now: float) -> None:
        self.serving[child.key].remove(child)
        child.process.send_signal(signal.SIGTERM)
        child.stopped_at = now
        self.stopping.append(child)
        logger.info("provisioner: draining the replica of %s:%s (pid %d)", *child.key, child.process.pid)

    def _free_device(self) -> str | None:
        in_use = {c.device for children in self.serving.values() for c in children} | {
            c.device
            for c in self.stopping  # a draining replica still holds its device's memory
        }
        for device in self.devices:
            if device == "cpu" or device not in in_use:
                return device
        return None
