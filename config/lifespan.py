"""The server's start and stop under uvicorn (ASGI lifespan): the server process's start and stop
(config/server_process.py, which says what they do), which daphne calls from its reactor instead
(config/daphne_host.py). The drain before the stop is serve.py's: uvicorn's shutdown runs it first."""

from __future__ import annotations

from typing import Any

from config.server_process import SERVER_PROCESS


async def lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            SERVER_PROCESS.start()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await SERVER_PROCESS.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return
