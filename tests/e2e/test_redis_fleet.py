"""Production mode: a gateway process and replica processes on the Redis channel layer and Postgres."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import redis

from serving.benchmarks.serve_platform import run_manage
from serving.gateway.in_flight import LIVENESS_CHECK_S
from serving.gateway.quota_redis import RedisQuotaStore
from serving.gateway.router import REVALIDATE_S
from serving.transport.protocol import HEARTBEAT_INTERVAL_S
from tests.conftest import REPO_ROOT, require_service
from tests.e2e.conftest import METRICS_TOKEN, LiveServer, _free_port

pytestmark = [pytest.mark.live_server_process, pytest.mark.redis]
REDIS_URL = "redis://127.0.0.1:6379/14"
POSTGRES_ADMIN_URL = os.environ.get("SWITCHYARD_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
FLEET_DATABASE = "switchyard_e2e_fleet"


def _fresh_postgres_database() -> str:
    """Production mode runs on Postgres: a database of its own for the fleet's processes, recreated
    empty (they migrate it). Skips outside CI when Postgres is not running; CI must have it."""
    import psycopg

    require_service("Postgres", "127.0.0.1", 5432)
    admin = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {FLEET_DATABASE} WITH (FORCE)")
        connection.execute(f"CREATE DATABASE {FLEET_DATABASE}")
    return POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + "/" + FLEET_DATABASE


NUM_KILL_STREAMS = 50
_STARTED_ON: list[str] = []  # the replica of every stream, as soon as its headers arrive


@dataclass
class Fleet:
    server: LiveServer
    replicas: dict[str, subprocess.Popen[bytes]]  # replica id -> process
    state: Path  # the processes' logs: server.log, and replica-N.log for each replica started
    log_of: dict[str, Path] = field(default_factory=dict)  # replica id -> its log

    def ready_replicas(self) -> set[str]:
        beats = self.server.replicas()
        return {r["replica_id"] for r in beats if r["state"] == "ready"}

    def start_replica(self) -> None:
        replica_id, process = self.launch_replica("demo-chat")
        self.replicas[replica_id] = process

    def launch_replica(self, model: str) -> tuple[str, subprocess.Popen[bytes]]:
        """A ready `run_replica` process of `model` v1 (not in `replicas`, which holds demo-chat's)."""
        before = self.ready_replicas()
        log_path = self.state / f"replica-{len(self.log_of)}.log"
        with log_path.open("wb") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(
                [
                    sys.executable,
                    "manage.py",
                    "run_replica",
                    "--model",
                    model,
                    "--version",
                    "v1",
                    "--kv-cache-mb",
                    "32",
                ],
                cwd=REPO_ROOT,
                env=self.server.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.server.wait_until(lambda: len(self.ready_replicas() - before) == 1, timeout_s=120)
        (replica_id,) = self.ready_replicas() - before
        self.log_of[replica_id] = log_path
        return replica_id, process

    def wait_for_exit(self, replica_id: str, timeout_s: float = 60) -> int:
        """The replica's exit code. One still running after `timeout_s` is made to print every thread's
        stack (faulthandler, on SIGABRT) and the test fails with its log and the gateway's: a hang
        here shows up in CI only, where nothing else would say where it waits."""
        process = self.replicas.pop(replica_id)
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            process.wait(30)
            tails = [
                f"--- {path.name} ---\n" + path.read_text(errors="replace")[-12000:]
                for path in (self.log_of[replica_id], self.state / "server.log")
            ]
            pytest.fail(f"replica {replica_id} still running {timeout_s:.0f} s on\n" + "\n".join(tails))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_service("Redis", "127.0.0.1", 6379)
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    # A replica left running by an interrupted run would beat into this database and be routed to (its
    # beats look like this fleet's): said here, rather than as a test failing for no visible reason.
    time.sleep(3 * HEARTBEAT_INTERVAL_S)
    strays = client.keys("switchyard:replicas:*")
    assert not strays, f"replicas of another run are beating into {REDIS_URL}: {strays} (kill them)"
    state = tmp_path_factory.mktemp("fleet")
    env = {
        **os.environ,
        "SWITCHYARD_STATE_DIR": str(state),
        "REDIS_URL": REDIS_URL,
        "DATABASE_URL": _fresh_postgres_database(),
        "SWITCHYARD_METRICS_TOKEN": METRICS_TOKEN,
        "PYTHONFAULTHANDLER": "1",  # a process sent SIGABRT prints every thread's stack
    }
    for name in ("SECRET_KEY", "DJANGO_SETTINGS_MODULE"):
        env.pop(name, None)

    run_manage(env, "migrate", "--noinput", "-v0")
    key = run_manage(env, "seed_demo").strip().splitlines()[-1]
    port = _free_port()
    log = (state / "server.log").open("wb")
    web = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port)],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = LiveServer(f"http://127.0.0.1:{port}", key, env, web)
    fleet = Fleet(server, {}, state)
    try:
        server.wait_until(lambda: httpx.get(f"{server.url}/healthz").status_code == 200)
        fleet.start_replica()
        fleet.start_replica()
        yield fleet
    finally:
        for process in [web, *fleet.replicas.values()]:
            if process.poll() is None:
                process.kill()
            process.wait()
        log.close()
        redis.Redis.from_url(REDIS_URL).flushdb()


def _stream(server: LiveServer, max_tokens: int, first_token: threading.Event | None = None) -> dict:
    """Stream /infer; return the served replica and every event."""
    events: list[dict] = []
    first_at = float("nan")
    with httpx.stream(
        "POST",
        f"{server.url}/v1/models/demo-chat/infer",
        headers={"Authorization": f"Bearer {server.key}"},
        json={"input": "hello", "max_tokens": max_tokens, "stream": True},
        timeout=60,
    ) as response:
        replica = response.headers["X-Served-Replica"]
        _STARTED_ON.append(replica)
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 1:
                    first_at = time.monotonic()
                    if first_token is not None:
                        first_token.set()
    return {"replica": replica, "events": events, "ended_at": time.monotonic(), "first_at": first_at}


def test_openai_client_streams_through_the_redis_layer(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=f"{fleet.server.url}/v1", api_key=fleet.server.key, max_retries=0)
    chunks = list(
        client.completions.create(
            model="demo-chat", prompt="hello", max_tokens=12, stream=True, temperature=0
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model="demo-chat", prompt="hello", max_tokens=12, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_embeddings_through_the_redis_layer_from_a_replica_process(fleet: Fleet) -> None:
    _, process = fleet.launch_replica("demo-embed")
    try:
        client = openai.OpenAI(base_url=f"{fleet.server.url}/v1", api_key=fleet.server.key, max_retries=0)
        texts = ["hello world", "the quick brown fox", "hello world"]
        result = client.embeddings.create(model="demo-embed", input=texts, encoding_format="float")
        first, second, again = ([*d.embedding] for d in result.data)
        assert first == pytest.approx(again, abs=1e-5)  # the same text, in another row of the batch
        assert first != pytest.approx(second, abs=1e-3)
        assert sum(x * x for x in second) == pytest.approx(1.0, abs=1e-5)  # mean-pooled and normalized
        with pytest.raises(openai.BadRequestError, match="takes at most 512"):
            client.embeddings.create(model="demo-embed", input="word " * 600)
    finally:
        process.kill()
        process.wait()


def test_a_classifier_through_the_redis_layer_from_a_replica_process(fleet: Fleet) -> None:
    _, process = fleet.launch_replica("demo-classify")
    try:
        response = httpx.post(
            f"{fleet.server.url}/v1/models/demo-classify/infer",
            headers={"Authorization": f"Bearer {fleet.server.key}"},
            json={"input": ["hello world", "the quick brown fox", "hello world"]},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.headers["X-Served-Version"] == "v1"
        first, second, again = (
            {p["label"]: p["score"] for p in labels} for labels in response.json()["predictions"]
        )
        assert set(first) == {"negative", "positive"}
        assert first == pytest.approx(again, abs=1e-5)  # the same text, in another row of the batch
        assert first != pytest.approx(second, abs=1e-6)
        assert sum(second.values()) == pytest.approx(1.0, abs=1e-5)
    finally:
        process.kill()
        process.wait()


def _set_target(fleet: Fleet, model: str, replicas: int) -> None:
    code = (
        "from registry.models import ModelVersion; from rollouts.models import ScaleTarget; "
        f"v = ModelVersion.objects.get(model__name={model!r}, version='v1'); "
        f"ScaleTarget.objects.update_or_create(version=v, defaults={{'replicas': {replicas}}})"
    )
    result = fleet.server.manage("shell", "-c", code)
    assert result.returncode == 0, result.stderr


def test_the_provisioner_runs_as_many_replica_processes_as_the_target_and_drains_the_extra(
    fleet: Fleet,
) -> None:
    def ready_replicas() -> int:
        beats = fleet.server.replicas()
        return sum(1 for r in beats if r["model"] == "demo-classify" and r["state"] == "ready")

    _set_target(fleet, "demo-classify", 2)
    log_path = fleet.state / "provisioner.log"
    with log_path.open("wb") as log:
        provisioner = subprocess.Popen(
            [
                *(sys.executable, "manage.py", "run_provisioner", "--model", "demo-classify"),
                *("--devices", "cpu", "--interval", "0.5"),
            ],
            cwd=REPO_ROOT,
            env=fleet.server.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        fleet.server.wait_until(lambda: ready_replicas() == 2, timeout_s=120)
        _set_target(fleet, "demo-classify", 1)
        fleet.server.wait_until(lambda: ready_replicas() == 1, timeout_s=60)
        response = httpx.post(
            f"{fleet.server.url}/v1/models/demo-classify/infer",
            headers={"Authorization": f"Bearer {fleet.server.key}"},
            json={"input": "hello"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        provisioner.send_signal(signal.SIGTERM)  # drains what it runs, then exits
        assert provisioner.wait(60) == 0, log_path.read_text()
        fleet.server.wait_until(lambda: ready_replicas() == 0, timeout_s=30)
    finally:
        if provisioner.poll() is None:
            provisioner.kill()
            provisioner.wait()
    text = log_path.read_text()
    assert text.count("started a replica of demo-classify:v1") == 2, text
    assert text.count("draining the replica of demo-classify:v1") == 2, text


def test_a_model_scaled_to_zero_gets_a_replica_for_a_request_and_loses_it_when_idle(fleet: Fleet) -> None:
    """The whole loop, every part real: Celery beat runs the autoscaler, the provisioner starts and drains
    replica processes, and the gateway holds the request that finds no replica until one is ready."""

    def ready_replicas() -> int:
        beats = fleet.server.replicas()
        return sum(1 for r in beats if r["model"] == "demo-classify" and r["state"] == "ready")

    assert ready_replicas() == 0
    _set_target(fleet, "demo-classify", 0)
    scaled = fleet.server.manage("set_scaling", "demo-classify", "--min", "0", "--max", "1")
    assert scaled.returncode == 0, scaled.stderr
    # The gateway learns it at its routing cache's next check (the last test's requests left an entry up
    # to REVALIDATE_S old); a request before then finds no replica and no leave to wait for one. The
    # gateway is another process, with nothing to await: the bound itself is the wait.
    time.sleep(2 * REVALIDATE_S)
    env = {
        **fleet.server.env,
        "SWITCHYARD_AUTOSCALER_INTERVAL_S": "0.5",
        "SWITCHYARD_AUTOSCALER_IDLE_BEFORE_ZERO_S": "5",
    }
    logs = {name: fleet.state / f"{name}.log" for name in ("celery", "provisioner-zero")}
    processes: list[subprocess.Popen[bytes]] = []
    commands = {
        "celery": [
            *(sys.executable, "-m", "celery", "-A", "config", "worker", "--beat", "--pool", "solo"),
            *("--schedule", str(fleet.state / "beat-schedule"), "--loglevel", "INFO"),
        ],
        "provisioner-zero": [
            *(sys.executable, "manage.py", "run_provisioner", "--model", "demo-classify"),
            *("--devices", "cpu", "--interval", "0.5"),
        ],
    }
    try:
        for name, command in commands.items():
            with logs[name].open("wb") as log:
                processes.append(
                    subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        response = httpx.post(
            f"{fleet.server.url}/v1/models/demo-classify/infer",
            headers={"Authorization": f"Bearer {fleet.server.key}"},
            json={"input": "hello"},
            timeout=150,  # the gateway holds it for up to SWITCHYARD_COLD_START_TIMEOUT_S (120 s)
        )
        assert response.status_code == 200, response.text
        assert response.json()["predictions"][0][0]["label"] in {"negative", "positive"}
        assert "started a replica of demo-classify:v1" in logs["provisioner-zero"].read_text()
        # five seconds without a request: the autoscaler scales it to zero and the provisioner drains it
        fleet.server.wait_until(lambda: ready_replicas() == 0, timeout_s=60)
        fleet.server.wait_until(
            lambda: "draining the replica of demo-classify:v1" in logs["provisioner-zero"].read_text(),
            timeout_s=30,
        )
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        fleet.server.manage("set_scaling", "demo-classify", "--clear")
    provisioner_log = logs["provisioner-zero"].read_text()
    assert provisioner_log.count("started a replica of demo-classify:v1") == 1, provisioner_log
    assert "autoscaler: demo-classify:v1 0 -> 1 replicas (kept warm" in logs["celery"].read_text()


def test_both_replicas_take_traffic(fleet: Fleet) -> None:
    served: set[str] = set()
    for _ in range(40):  # both within a few requests; more only if a heartbeat runs late under load
        served.add(_stream(fleet.server, 4)["replica"])
        if served == set(fleet.replicas):
            break
    assert served == set(fleet.replicas)


def test_killing_a_replica_mid_stream_ends_its_streams_with_an_error_and_spares_the_others(
    fleet: Fleet,
) -> None:
    results: list[dict] = []
    threads: list[threading.Thread] = []
    started: list[threading.Event] = []

    def start_stream() -> None:
        event = threading.Event()
        started.append(event)
        thread = threading.Thread(target=lambda: results.append(_stream(fleet.server, 150, event)))
        threads.append(thread)
        thread.start()

    def replicas_streaming() -> set[str]:
        return {r["replica"] for r in results}  # filled when a stream ends; see started_on below

    # 50 streams at once (docs/reliability.md, "Replica failures"); power of two choices spreads them
    # over both replicas, though a heartbeat arriving late on a loaded machine can send a burst to one.
    _STARTED_ON.clear()  # only this test's streams
    victim, survivor = list(fleet.replicas)
    # Short requests one after another, from the streams' start to the end: the survivor's TTFT before
    # the kill (under the streams' load) and after it.
    probes = _Probes(fleet.server)
    probes.start()
    for _ in range(NUM_KILL_STREAMS):
        start_stream()
    assert all(event.wait(120) for event in started)
    started_on = {replica for replica in _STARTED_ON if replica in fleet.replicas}
    assert started_on == set(fleet.replicas), "the load should have spread over both replicas"
    # A few of the baseline's probes, without waiting so long that the victim's streams end first.
    probes.wait_for(survivor, count=3, timeout_s=5)
    fleet.replicas.pop(victim).send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    dropped_after_s = _seconds_until_unlisted(fleet.server, victim, since=killed_at)
    for thread in threads:
        thread.join(120)
    probes.stop()
    assert replicas_streaming() <= started_on

    on_victim = [r for r in results if r["replica"] == victim]
    on_others = [r for r in results if r["replica"] != victim]
    assert on_victim
    assert on_others
    for result in on_victim:
        final = result["events"][-1]
        assert final["finish_reason"] == "error"
        assert final["error"]["type"] == "replica_lost"
    # Each ends once the gateway finds the replica's heartbeat stale (STALE_AFTER_S after its last beat)
    # at its next liveness check (LIVENESS_CHECK_S): within 2 s of the kill (docs/reliability.md).
    ended_after_s = max(r["ended_at"] - killed_at for r in on_victim)
    before, after = probes.ttfts(survivor, before=killed_at), probes.ttfts(survivor, after=killed_at)
    print(
        f"\n{len(on_victim)} streams on the killed replica, all ended {ended_after_s:.2f} s after the kill; "
        f"the gateway stopped listing it after {dropped_after_s:.2f} s; the survivor's TTFT, "
        f"before the kill: p50 {_pct(before, 50):.3f} s p99 {_pct(before, 99):.3f} s over {len(before)}, "
        f"after: p50 {_pct(after, 50):.3f} s p99 {_pct(after, 99):.3f} s over {len(after)} "
        f"(p99 ratio {_pct(after, 99) / _pct(before, 99):.2f}); "
        f"{probes.retried_after(killed_at)} probe(s) sent to the dead replica and retried"
    )
    assert ended_after_s <= 2.0
    # The router's candidates are the replicas whose beat is fresh, the test /readyz lists them by:
    # gone within 3 heartbeats of the kill (+ the poll's own period).
    assert dropped_after_s <= 3 * HEARTBEAT_INTERVAL_S + 0.1
    for result in on_others:
        assert result["events"][-1]["finish_reason"] == "length"
        assert len(result["events"]) == 151
    # No probe failed: one sent to the dead replica before the router knew was retried on the survivor
    # (one already streaming from it when it died ends with replica_lost, as the streams above do).
    assert probes.failures == []
    # The router stops choosing the dead replica: every new request lands on the survivor.
    assert {_stream(fleet.server, 2)["replica"] for _ in range(6)} == {survivor}


def _seconds_until_unlisted(server: LiveServer, replica_id: str, *, since: float) -> float:
    """How long after `since` the gateway's replica list (/readyz) stopped naming `replica_id`."""
    while time.monotonic() - since < 30:
        if replica_id not in {r["replica_id"] for r in server.replicas()}:
            return time.monotonic() - since
        time.sleep(0.05)
    pytest.fail(f"the gateway still lists {replica_id} 30 s after its kill")


def _pct(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else float("nan")


class _Probes:
    """One client sending 2-token streams one after another: each one's send time, time to its first
    token and serving replica (the survivor's TTFT before and after the kill)."""

    def __init__(self, server: LiveServer) -> None:
        self._server = server
        self._stopped = threading.Event()
        self._landed = threading.Condition()
        self.samples: list[tuple[float, float, str]] = []  # (sent at, TTFT, replica)
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(60)

    def wait_for(self, replica: str, *, count: int, timeout_s: float) -> bool:
        with self._landed:
            return self._landed.wait_for(
                lambda: sum(r == replica for _, _, r in self.samples) >= count, timeout_s
            )

    def ttfts(self, replica: str, *, before: float = float("inf"), after: float = 0.0) -> list[float]:
        return [t for sent, t, r in self.samples if r == replica and after < sent < before]

    def retried_after(self, at: float) -> int:
        # The retry is invisible to the client but for its wait: one liveness check at least.
        return sum(1 for sent, t, _ in self.samples if sent > at and t >= LIVENESS_CHECK_S)

    def _run(self) -> None:
        first = threading.Event()
        while not self._stopped.is_set():
            sent_at = time.monotonic()
            first.clear()
            try:
                result = _stream(self._server, 2, first)
            except (httpx.HTTPError, KeyError) as exc:
                self.failures.append(repr(exc))
                continue
            if result["events"][-1].get("finish_reason") != "length" and not _cut_after_a_token(result):
                self.failures.append(json.dumps(result["events"][-1]))
            with self._landed:
                self.samples.append((sent_at, result["first_at"] - sent_at, result["replica"]))
                self._landed.notify_all()


def _cut_after_a_token(result: dict) -> bool:
    """A probe whose replica died after its first token: it ends with a replica_lost event, as documented
    (docs/reliability.md, "Replica failures"), since a retry would repeat text the client has seen."""
    *tokens, final = result["events"]
    return bool(tokens) and final.get("error", {}).get("type") == "replica_lost"


def _streams_under(fleet: Fleet, fault: Callable[[], None], *, num: int = 8) -> tuple[list[dict], float]:
    """`num` streams of 150 tokens, `fault()` once each has its first token; then every stream's result
    (its events, or the error that ended it) and how long after the fault the service answered again."""
    results: list[dict] = []
    started = [threading.Event() for _ in range(num)]

    def stream(first: threading.Event) -> None:
        try:
            results.append(_stream(fleet.server, 150, first))
        except (httpx.HTTPError, KeyError) as exc:  # refused (no X-Served-Replica), or cut off
            results.append({"replica": None, "events": [], "error": repr(exc)})
            first.set()

    threads = [threading.Thread(target=stream, args=(first,)) for first in started]
    for thread in threads:
        thread.start()
    assert all(first.wait(60) for first in started)
    fault()
    faulted_at = time.monotonic()
    answered: list[float] = []

    def probe() -> None:  # polled: the service's recovery is what is measured, from the fault on
        while not answered and time.monotonic() - faulted_at < 60:
            try:
                if _stream(fleet.server, 2)["events"][-1].get("finish_reason") == "length":
                    answered.append(time.monotonic() - faulted_at)
                    return
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.5)

    prober = threading.Thread(target=probe)
    prober.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a stream hung"
    prober.join(90)
    assert answered, "the service did not come back"
    return results, answered[0]


def _summary(results: list[dict]) -> str:
    ends = [
        (r["events"][-1].get("error", {}).get("type") or r["events"][-1].get("finish_reason"))
        if r["events"]
        else r["error"][:40]
        for r in results
    ]
    return ", ".join(f"{end}: {ends.count(end)}" for end in sorted(set(map(str, ends))))


def test_redis_paused_for_5_s_hangs_no_stream_and_the_service_comes_back(fleet: Fleet) -> None:
    def pause() -> None:
        redis.Redis.from_url(REDIS_URL).execute_command("CLIENT", "PAUSE", 5000, "ALL")

    counted_before = _settled_output_tokens_counted()
    results, recovered_after_s = _streams_under(fleet, pause)
    served, counted = _tokens_counted_since(counted_before, results)
    in_flight = _requests_in_flight()
    print(
        f"\nRedis paused 5 s under 8 streams: {_summary(results)}; "
        f"answering again {recovered_after_s:.1f} s after; {served} tokens served, {counted} counted; "
        f"{in_flight} request(s) still held by the quota"
    )
    assert all(r["events"] and r["events"][-1].get("finish_reason") == "length" for r in results)
    assert recovered_after_s <= 5 + 30
    assert counted == served, f"{served} tokens served, {counted} counted in the metrics"
    assert in_flight == 0


def test_postgres_connections_terminated_under_load_hang_no_stream(fleet: Fleet) -> None:
    import psycopg

    def terminate() -> None:
        admin = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (FLEET_DATABASE,)
            )

    counted_before = _settled_output_tokens_counted()
    results, recovered_after_s = _streams_under(fleet, terminate)
    served, counted = _tokens_counted_since(counted_before, results)
    in_flight = _requests_in_flight()
    print(
        f"\nPostgres connections ended under 8 streams: {_summary(results)}; "
        f"answering {recovered_after_s:.1f} s after; {served} tokens served, {counted} counted; "
        f"{in_flight} request(s) still held by the quota"
    )
    assert all(r["events"] and r["events"][-1].get("finish_reason") == "length" for r in results)
    assert recovered_after_s <= 30
    assert counted == served, f"{served} tokens served, {counted} counted in the metrics"
    assert in_flight == 0


def _tokens_counted_since(counted_before: int, results: list[dict]) -> tuple[int, int]:
    """The tokens served since `counted_before` was read (the streams' and the recovery probe's 2), and
    those the version's metrics count, once every flush that met the fault has landed: each in once.
    Polled: flushes come every few seconds."""
    served = sum(r["events"][-1]["usage"]["completion_tokens"] for r in results if r["events"]) + 2
    deadline = time.monotonic() + 60
    while _output_tokens_counted() - counted_before < served and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2 * 5)  # two more flush periods: a row written twice would show by now
    return served, _output_tokens_counted() - counted_before


@dataclass(frozen=True)
class _Limits:
    """A tenant's limits as the quota store's usage() reads them (its counters are what is checked)."""

    tenant_id: int
    requests_per_second: float = 1.0
    tokens_per_minute: int = 1
    max_concurrent_requests: int = 1


def _requests_in_flight() -> int:
    """Requests the quota still counts in flight, over every tenant, read from Redis as every gateway
    would: once the streams have ended, a lease the fault kept from being released shows here."""
    import psycopg

    url = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/" + FLEET_DATABASE
    with psycopg.connect(url) as connection:
        tenant_ids = [row[0] for row in connection.execute("SELECT id FROM registry_tenant")]
    usage = RedisQuotaStore(REDIS_URL).usage([_Limits(tenant_id) for tenant_id in tenant_ids])
    assert len(usage) == len(tenant_ids), "Redis unreadable"
    return sum(u.num_in_flight for u in usage.values())


def _settled_output_tokens_counted() -> int:
    """The count once the earlier tests' tokens are all flushed: the same over a whole flush period.
    Polled: the replicas flush on a timer of their own, which nothing outside them can await."""
    counted = _output_tokens_counted()
    while True:
        time.sleep(6)  # one flush period (SWITCHYARD_METRICS_FLUSH_INTERVAL_S, 5 s) and a margin
        again = _output_tokens_counted()
        if again == counted:
            return counted
        counted = again


def _output_tokens_counted() -> int:
    """demo-chat's output tokens in the metrics store, over its 5 s rows (the rows replicas write)."""
    import psycopg

    url = POSTGRES_ADMIN_URL.replace("postgres://", "postgresql://").rsplit("/", 1)[0] + "/" + FLEET_DATABASE
    with psycopg.connect(url) as connection:
        row = connection.execute(
            "SELECT COALESCE(SUM((w.counters->>'output_tokens')::bigint), 0) FROM serving_metricwindow w "
            "JOIN registry_modelversion v ON v.id = w.version_id JOIN registry_model m ON m.id = v.model_id "
            "WHERE m.name = 'demo-chat' AND w.resolution_s = 5"
        ).fetchone()
    return int(row[0]) if row else 0


def test_sigterm_drains_a_replica_before_it_exits(fleet: Fleet) -> None:
    fleet.start_replica()
    first_token = threading.Event()
    results: list[dict] = []
    streams = [threading.Thread(target=lambda: results.append(_stream(fleet.server, 150, first_token)))]
    streams[0].start()
    assert first_token.wait(60)
    for rid, process in list(fleet.replicas.items()):
        process.send_signal(signal.SIGTERM)  # every replica drains; in-flight work must still finish
        assert fleet.wait_for_exit(rid) == 0
    streams[0].join(60)
    assert results[0]["events"][-1]["finish_reason"] == "length"
