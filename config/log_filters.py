"""Filters for what the server's libraries log."""

from __future__ import annotations

import logging


class WebSocketPathOnly(logging.Filter):
    """uvicorn logs each WebSocket handshake at INFO with its query string, even with its access log off.
    A browser cannot set Authorization on a WebSocket, so a client may try `?api_key=sy-…`: refused (no
    key is read from a query string), and then written in the clear to the log. The path stays; the
    query is replaced by "?…"."""

    def filter(self, record: logging.LogRecord) -> bool:
        if '"WebSocket %s"' in str(record.msg) and isinstance(record.args, tuple) and len(record.args) >= 2:
            path = record.args[1]
            if isinstance(path, str) and "?" in path:
                record.args = (record.args[0], path.split("?", 1)[0] + "?…", *record.args[2:])
        return True
