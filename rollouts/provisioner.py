"""The provisioner for one machine: runs `manage.py run_replica` processes so that each model version
has as many replicas as its target says (rollouts.selectors.wanted_replicas: the autoscaler's targets).

`manage.py run_provisioner` calls `reconcile` every few seconds. It starts what is missing; it stops what
is over with SIGTERM, on which a replica drains (admits nothing new, finishes what it holds) and exits,
so scaling down loses no request; the newest replica goes first. A replica that exits on its own is
started again, but not sooner than `restart_delay_s` after it died, so a version whose replica cannot
load does not spin. With devices given (`cuda:0,cuda:1`), each replica gets a device of its own and a
version waits when none is free; `cpu` is shared by any number.

Beyond one machine, a Kubernetes Deployment per version with `replicas` set to the same target does
this job (not built here: no cluster to run it against)."""

from __future__ import annotations

import logging
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


def run_replica_launcher(manage_py: Path, *, extra_args: Sequence[str] = ()) -> Launcher:
    """Starts `python manage.py run_replica` with this process's environment (database, Redis)."""

    def launch(model: str, version: str, device: str) -> Process:
        command = [sys.executable, str(manage_py), "run_replica", "--model", model, "--version", version]
        return subprocess.Popen([*command, "--device", device, *extra_args], cwd=manage_py.parent)

    return launch


@dataclass(slots=True)
class _Child:
    key: Key
    device: str
    process: Process
    started_at: float


@dataclass(slots=True)
class LocalProvisioner:
    launch: Launcher
    devices: Sequence[str] = ("cpu",)
    models: frozenset[str] | None = None  # only these models' versions; None: every model
    restart_delay_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    serving: dict[Key, list[_Child]] = field(default_factory=dict)
    stopping: list[_Child] = field(default_factory=list)  # sent SIGTERM, draining
    _died_at: dict[Key, float] = field(default_factory=dict)

    def reconcile(self, targets: Mapping[Key, int]) -> None:
        """One pass: reap the children that exited, then start or stop replicas to meet the targets (a
        version without a target, or of a model this provisioner does not serve, wants none)."""
        now = self.clock()
        self._reap(now)
        wanted = {k: n for k, n in targets.items() if self.models is None or k[0] in self.models}
        for key in sorted(set(self.serving) | set(wanted)):
            children = self.serving.setdefault(key, [])
            missing = wanted.get(key, 0) - len(children)
            if missing < 0:
                for child in sorted(children, key=lambda c: c.started_at)[missing:]:
                    self._stop(child)
            elif missing > 0 and now - self._died_at.get(key, -1e18) >= self.restart_delay_s:
                for _ in range(missing):
                    if not self._start(key, now):
                        break
            if not children:
                del self.serving[key]

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop every replica (each drains first) and wait for them to exit; kill what outlives the wait."""
        for children in list(self.serving.values()):
            for child in list(children):
                self._stop(child)
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
        for key, children in self.serving.items():
            for child in [c for c in children if c.process.poll() is not None]:
                children.remove(child)
                self._died_at[key] = now
                logger.warning(
                    "provisioner: replica of %s:%s (pid %d) exited with %s; restarted in %g s or later",
                    *key,
                    child.process.pid,
                    child.process.poll(),
                    self.restart_delay_s,
                )

    def _start(self, key: Key, now: float) -> bool:
        device = self._free_device()
        if device is None:
            logger.warning("provisioner: no free device for another replica of %s:%s", *key)
            return False
        process = self.launch(key[0], key[1], device)
        self.serving.setdefault(key, []).append(_Child(key, device, process, now))
        logger.info("provisioner: started a replica of %s:%s on %s (pid %d)", *key, device, process.pid)
        return True

    def _stop(self, child: _Child) -> None:
        self.serving[child.key].remove(child)
        child.process.send_signal(signal.SIGTERM)
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
