"""How the audit log and the rollout histories name who made a change, one spelling per kind of caller,
so that filtering the log by "alice" or "acme" finds everything they did by any path."""

from __future__ import annotations

import getpass
import os
from typing import Any

# A caller that named no one (code that predates the audit log, a test): still recorded, as this.
SYSTEM = "system"


def staff(user: Any) -> str:
    """A signed-in staff user, from the API, the dashboard or the admin."""
    return f"staff:{user.get_username()}"


def tenant(name: str) -> str:
    """A tenant calling the API with its key."""
    return f"tenant:{name}"


def command(module_name: str) -> str:
    """A management command, by its module's name (pass __name__), and the operating-system user who ran
    it: the database does not know who is at the shell."""
    return f"command:{module_name.rsplit('.', 1)[-1]} ({_os_user()})"


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name and no passwd entry (a container's arbitrary uid): the uid says who
        return f"uid {os.getuid()}"
