"""Where the dashboard's per-replica queue depth comes from: in-process replicas and replica processes'
heartbeats report the requests waiting for a batch slot, apart from the ones running."""

from __future__ import annotations

import time

from registry.selectors import VersionRef
from serving.replica.replica import Replica
from serving.runtime import Runtime
from serving.transport.replica_directory import Heartbeat


async def test_replica_processes_report_queue_depth_through_their_heartbeats() -> None:
    beat = Heartbeat(
        replica_id="r-remote",
        model_name="chat",
        version="v1",
        channel_name="switchyard.replica.chat.v1.r-remote",
        state="ready",
        num_waiting=6,
        num_running=3,
        kv_cache_usage=0.4,
        sent_at=time.time(),
    )

    class Directory:
        async def all_replicas(self) -> list[Heartbeat]:
            return [beat]

        async def replicas(self, model_name: str, version: str, **cache: bool) -> list[Heartbeat]:
            return [beat]

    runtime = Runtime(layer=None)
    runtime.directory = Directory()  # type: ignore[assignment]
    for handles in (await runtime.all_replicas(), await runtime.candidates("chat", "v1")):
        (handle,) = handles
        assert (handle.queue_depth, handle.num_running, handle.load) == (6, 3, 9)
        assert not handle.is_local


async def test_an_in_process_replica_reports_what_its_heartbeat_would() -> None:
    ref = VersionRef("chat", "v1", 1, "/nowhere", "0" * 64, {})
    replica = Replica(ref, layer=None)  # not started: nothing loads, no thread runs
    runtime = Runtime(layer=None)
    runtime.replicas[("chat", "v1")] = replica
    replica.load_report.num_waiting, replica.load_report.num_running = 2, 3
    replica.inbox.count_in(None)  # arrived, not yet handed to the engine: waiting too
    (handle,) = await runtime.all_replicas()
    beat = replica.heartbeat()
    assert (handle.queue_depth, handle.num_running) == (beat.num_waiting, beat.num_running) == (3, 3)
    assert handle.load == 6 and handle.is_local
