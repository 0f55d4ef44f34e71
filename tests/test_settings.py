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
