"""The embedded default's secret key: made once per state directory, readable by its owner only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT


def _secret_key(state: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DJANGO_SETTINGS_MODULE")}
    env["SWITCHYARD_STATE_DIR"] = str(state)
    code = "import config.settings as s; print(s.SECRET_KEY)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_the_key_file_is_the_owners_alone_and_kept(tmp_path: Path) -> None:
    key = _secret_key(tmp_path)
    key_file = tmp_path / "secret_key"
    assert len(key) >= 50 and key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret_key"]  # no temporary file left
    assert _secret_key(tmp_path) == key


def test_a_key_file_left_readable_by_others_is_tightened(tmp_path: Path) -> None:
    key_file = tmp_path / "secret_key"
    key_file.write_text("k" * 50)
    key_file.chmod(0o644)
    assert _secret_key(tmp_path) == "k" * 50
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_a_postgres_server_that_never_answers_fails_the_connect_within_seconds(tmp_path: Path) -> None:
    """A database behind a partition accepts nothing and refuses nothing. Without libpq's timeouts a
    connect to it waits for ever, and with it every request thread that needs the database; with them
    the call fails, and the gateway's fallbacks (the last good routing table) take over."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))  # the kernel completes the handshake; nobody answers
    try:
        port = silent.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DJANGO_SETTINGS_MODULE")}
        env.update(
            SWITCHYARD_STATE_DIR=str(tmp_path),
            DATABASE_URL=f"postgres://postgres@127.0.0.1:{port}/switchyard",
            DJANGO_SETTINGS_MODULE="config.settings",
        )
        code = (
            "import time, django\n"
            "django.setup()\n"
            "from django.db import connection\n"
            "started = time.monotonic()\n"
            "try:\n"
            "    connection.ensure_connection()\n"
            "except Exception as exc:\n"
            "    print(type(exc).__name__, round(time.monotonic() - started, 1))\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        silent.close()
    name, seconds = result.stdout.split()
    assert name == "OperationalError", result.stderr
    assert float(seconds) < 15


def test_with_a_secret_key_of_its_own_the_embedded_database_still_opens_in_a_fresh_state_dir(
    tmp_path: Path,
) -> None:
    """The state directory was made only where the key file is written: with SECRET_KEY set, sqlite
    could not create its file ("unable to open database file")."""
    state = tmp_path / "fresh"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(SECRET_KEY="s" * 50, SWITCHYARD_STATE_DIR=str(state), DJANGO_SETTINGS_MODULE="config.settings")
    code = "import django; django.setup(); from django.db import connection; connection.ensure_connection()"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert (state / "switchyard.sqlite3").exists()


def test_a_secret_key_makes_the_server_https_only_even_with_debug_on(tmp_path: Path) -> None:
    """DEBUG=1 on a production host had turned off secure cookies, the HTTPS redirect and HSTS too."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(SECRET_KEY="s" * 50, DEBUG="1", SWITCHYARD_STATE_DIR=str(tmp_path))
    code = (
        "import config.settings as s; "
        "print(s.DEBUG, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, "
        "s.SECURE_SSL_REDIRECT, s.SECURE_HSTS_SECONDS)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["True", "True", "True", "True", "31536000"]
