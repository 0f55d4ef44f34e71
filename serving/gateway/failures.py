"""Requests that fail where no replica can count them, counted into their version's metrics by the gateway.

A replica counts every request that ends on it (serving/telemetry/recorder.py), and the rollout judge reads
those counts. Some requests never end on one: their replica died or went silent and the one retry found no
other, or the version had no ready replica at all. Without these counts a canary whose replicas crash would
look healthier the more they crash. The gateway records each such request as one that ended in an error, under
a replica id of its own ("gateway-<host>-<pid>"); the store merges its rows with the replicas' on read, so
every reader (the judge, the dashboard, /metrics) sees them.

A request counted here is normally not counted by a replica too: a dead replica counts nothing, and one
that was only silent sees the gateway's abort, which it counts as an abort (not a request). (One that
was silent only to the gateway, its events lost on the way, may finish the request before the abort
arrives and count it as served.) A replica's own refusal (replica_unavailable: draining, not ready) it
counts itself, as a rejection; the gateway counts what the request met after it."""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass

from registry.models import ModelVersion
from serving.telemetry.recorder import MetricsRecorder, RequestSample, register_recorder, unregister_recorder
from serving.transport.protocol import NO_READY_REPLICA, REPLICA_LOST, REPLICA_TIMEOUT

logger = logging.getLogger(__name__)

# The causes, as the error type in the version's counters (errors.<type>).
GATEWAY_COUNTED = frozenset({REPLICA_LOST, REPLICA_TIMEOUT, NO_READY_REPLICA})


def gateway_replica_id() -> str:
    suffix = f"-{os.getpid()}"
    return f"gateway-{socket.gethostname()}"[: 64 - len(suffix)] + suffix  # MetricWindow.replica_id's length


class GatewayFailures:
    """One process's counts, a MetricsRecorder per version. `record` is called on the event loop; `flush`
    blocks on the database (a worker thread)."""

    def __init__(self, *, replica_id: str | None = None) -> None:
        self.replica_id = replica_id or gateway_replica_id()
        self._lock = threading.Lock()
        self._recorders: dict[tuple[str, str], MetricsRecorder] = {}

    def record(self, model_name: str, version: str, error_type: str) -> None:
        key = (model_name, version)
        with self._lock:
            recorder = self._recorders.get(key)
            if recorder is None:
                # Its version's id is looked up by the first flush: not on the request's way.
                recorder = MetricsRecorder(
                    model_name=model_name, version=version, version_id=0, replica_id=self.replica_id
                )
                self._recorders[key] = recorder
                register_recorder(recorder)  # /metrics shows them beside the replicas'
        recorder.record(requests=[RequestSample(finish_reason="error", error_type=error_type)])

    def flush(self) -> int:
        """Write what was recorded since the last flush. Returns the number of windows written. Counts of
        a version that no longer exists are dropped; on a database error they stay for the next flush,
        and (once every version has been tried) the error propagates."""
        with self._lock:
            recorders = list(self._recorders.items())
        unresolved = [(key, r) for key, r in recorders if r.version_id == 0]
        if unresolved:
            ids = {
                (model_name, version): pk
                for pk, model_name, version in ModelVersion.objects.filter(
                    model__name__in={model_name for (model_name, _), _ in unresolved}
                ).values_list("pk", "model__name", "version")
            }
            for key, recorder in unresolved:
                if key in ids:
                    recorder.version_id = ids[key]
                else:
                    logger.warning("gateway failures of %s:%s dropped: no such version", *key)
                    with self._lock:
                        self._recorders.pop(key, None)
                    unregister_recorder(recorder)
        num_written, failed = 0, None
        for _, recorder in recorders:
            if recorder.version_id:
                try:
                    num_written += recorder.flush()
                except Exception as exc:  # kept for the next flush; the other versions' go on
                    failed = exc
        if failed is not None:
            raise failed
        return num_written

    def close(self) -> None:
        with self._lock:
            recorders, self._recorders = list(self._recorders.values()), {}
        for recorder in recorders:
            unregister_recorder(recorder)


@dataclass(slots=True)
class FailureNote:
    """The failure a request met on its way, the first of a retry's chain, if it is one the gateway
    counts (GATEWAY_COUNTED): a replica that refused (replica_unavailable: draining, not ready) counts
    that itself, as a rejection; what the request then met (no other replica, a lost one) is the
    gateway's to count, once, if the request ends in it. `counts`: only a client's request to a version
    with traffic is counted (not a shadow copy)."""

    counts: bool
    error_type: str | None = None
    is_counted: bool = False

    def note(self, error_type: str | None) -> None:
        if self.error_type is None and error_type in GATEWAY_COUNTED:
            self.error_type = error_type

    def count_once(self, failures: GatewayFailures, model_name: str, version: str) -> None:
        if self.counts and self.error_type is not None and not self.is_counted:
            self.is_counted = True
            failures.record(model_name, version, self.error_type)
