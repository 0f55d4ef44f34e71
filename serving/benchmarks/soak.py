"""A soak: `make serve`'s platform under mixed load for a long while, to show what a unit test cannot, that
nothing grows (docs/reliability.md, "Soak"). `python -m serving.benchmarks.soak --minutes 30`.

One server process in a state directory of its own (the embedded default: SQLite, in-process replicas),
and a load of 16 clients looping over SSE /infer (40%), WebSocket streams (30%), non-streamed chat
completions (20%) and embeddings (10%), one stream in ten left at a random token. Halfway, the chat
model's replica is restarted under the load: its traffic moves to a second version of the same weights
and back, so the replica drains and stops and a new one loads (the supervisor's path, as a rollout's).

Measured after a warm-up (WARMUP_S) and at the end, once the load has stopped and the replicas are idle:
the server's resident memory and open file descriptors (/proc), and the replicas' queue and KV cache
(/readyz). Prints one JSON object; the figures the issue asks for are `rss_growth_mb`, `fds` and `kv`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

from serving.benchmarks.serve_platform import REPO_ROOT, _free_port, platform_env, run_manage

WARMUP_S = 180.0
CLIENTS = 16
METRICS_TOKEN = "soak-metrics-token"
SAMPLE_EVERY_S = 10.0


def _proc(pid: int) -> tuple[float, int]:
    """The process's resident memory (MB) and open file descriptors."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


class Soak:
    def __init__(self, minutes: float, seed: int) -> None:
        self.duration_s = minutes * 60
        self.rng = random.Random(seed)
        self.state = Path(tempfile.mkdtemp(prefix="switchyard-soak-"))
        self.env = {
            **platform_env(self.state),
            "SWITCHYARD_METRICS_TOKEN": METRICS_TOKEN,
            "SWITCHYARD_REPLICA_SYNC_INTERVAL_S": "1",
        }
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.counts: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.samples: list[dict[str, float]] = []

    def manage(self, *args: str) -> str:
        return run_manage(self.env, *args)

    def start(self) -> None:
        self.manage("migrate", "--noinput", "-v0")
        self.manage("seed_demo")
        self.manage("create_tenant", "soak", "--max-concurrent", "1000", "--requests-per-second", "10000",
                    "--tokens-per-minute", "1000000000")  # fmt: skip
        self.key = self.manage("create_api_key", "--tenant", "soak").strip().splitlines()[-1]
        model_dir = json.loads(self.manage("shell", "-c", _ARTIFACT_OF_V1).strip().splitlines()[-1])["path"]
        self.manage(
            "register_model", "demo-chat", "v1b", "--from", model_dir
        )  # the same weights: the restart's target
        self.log = (self.state / "server.log").open("wb")
        self.server = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", str(self.port)],
            cwd=REPO_ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not get ready")

    def stop(self) -> None:
        self.server.terminate()
        try:
            self.server.wait(60)
        except subprocess.TimeoutExpired:
            self.server.kill()
        self.log.close()

    def _count(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1

    async def _sse(self, client: httpx.AsyncClient) -> None:
        leave_at = self.rng.randrange(1, 60) if self.rng.random() < 0.1 else None
        body = {"input": "once upon a time", "max_tokens": 64, "stream": True}
        async with client.stream(
            "POST", "/v1/models/demo-chat/infer", json=body, headers=self._auth
        ) as response:
            n = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if leave_at is not None and n > leave_at:
                        self._count("sse_left")
                        return
            self._count(f"sse_{response.status_code}")

    async def _ws(self) -> None:
        leave_at = self.rng.randrange(1, 60) if self.rng.random() < 0.1 else None
        url = self.url.replace("http://", "ws://") + "/v1/models/demo-chat/stream"
        async with websockets.connect(url, additional_headers=self._auth) as socket:
            await socket.send(json.dumps({"type": "infer", "input": "once upon a time", "max_tokens": 64}))
            n = 0
            while True:
                message = json.loads(await asyncio.wait_for(socket.recv(), timeout=120))
                n += 1
                if message["type"] != "token":
                    self._count(f"ws_{message['type']}")
                    return
                if leave_at is not None and n > leave_at:
                    self._count("ws_left")
                    return

    async def _chat(self, client: httpx.AsyncClient) -> None:
        body = {"model": "demo-chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 32}
        response = await client.post("/v1/chat/completions", json=body, headers=self._auth)
        self._count(f"chat_{response.status_code}")

    async def _embed(self, client: httpx.AsyncClient) -> None:
        response = await client.post(
            "/v1/embeddings", json={"model": "demo-embed", "input": ["a", "b"]}, headers=self._auth
        )
        self._count(f"embed_{response.status_code}")

    async def _client(self, client: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            kind = self.rng.random()
            try:
                if kind < 0.4:
                    await self._sse(client)
                elif kind < 0.7:
                    await self._ws()
                elif kind < 0.9:
                    await self._chat(client)
                else:
                    await self._embed(client)
            except Exception as exc:  # counted, not fatal: the soak looks at what is left afterwards
                self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1

    def _readyz(self) -> list[dict[str, Any]]:
        auth = {"Authorization": f"Bearer {METRICS_TOKEN}"}
        return httpx.get(f"{self.url}/readyz", headers=auth, timeout=30).json()["replicas"]  # type: ignore[no-any-return]

    async def _sample(self, until: float, started: float) -> None:
        while time.monotonic() < until:
            rss_mb, fds = _proc(self.server.pid)
            self.samples.append(
                {"t_s": round(time.monotonic() - started, 1), "rss_mb": round(rss_mb, 1), "fds": fds}
            )
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def _restart_replica(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        await asyncio.to_thread(self.manage, "set_traffic", "demo-chat", "v1b=100")
        await asyncio.sleep(30)
        await asyncio.to_thread(self.manage, "set_traffic", "demo-chat", "v1=100")
        self.restarted = True

    async def run(self) -> dict[str, Any]:
        self._auth = {"Authorization": f"Bearer {self.key}"}
        started = time.monotonic()
        until = started + self.duration_s
        limits = httpx.Limits(max_connections=CLIENTS * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as client:
            await asyncio.gather(
                self._sample(until, started),
                self._restart_replica(started + self.duration_s / 2),
                *(self._client(client, until) for _ in range(CLIENTS)),
            )
        deadline = time.monotonic() + 60
        while any(r["load"] or r["kv_cache_usage"] for r in self._readyz()) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)  # the last aborts and drains land
        end_rss, end_fds = _proc(self.server.pid)
        warm = [s for s in self.samples if s["t_s"] >= WARMUP_S] or self.samples
        baseline = warm[0]
        return {
            "minutes": self.duration_s / 60,
            "requests": self.counts,
            "client_errors": self.errors,
            "rss_mb_after_warmup": baseline["rss_mb"],
            "rss_mb_end": round(end_rss, 1),
            "rss_growth_mb": round(end_rss - baseline["rss_mb"], 1),
            "rss_mb_peak": max(s["rss_mb"] for s in self.samples),
            "fds": {"after_warmup": baseline["fds"], "end": end_fds},
            "kv": [
                {"model": r["model"], "version": r["version"], "load": r["load"], "kv": r["kv_cache_usage"]}
                for r in self._readyz()
            ],
            "samples": self.samples,
        }


# The demo chat model's artifact directory, for a second version of the same weights.
_ARTIFACT_OF_V1 = (
    "import json; from registry.models import ModelVersion; "
    "v = ModelVersion.objects.get(model__name='demo-chat', version='v1'); "
    "print(json.dumps({'path': v.artifact_uri}))"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Mixed load for a long while; prints what grew.")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    soak = Soak(args.minutes, args.seed)
    soak.start()
    try:
        result = asyncio.run(soak.run())
    finally:
        soak.stop()
        shutil.rmtree(soak.state, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
