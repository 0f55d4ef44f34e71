"""The import root (settings.ARTIFACT_IMPORT_ROOT): the one directory the API may copy model directories
from. A caller names a directory under it; the path is resolved, symbolic links followed, and refused
unless it stays inside, so no request can make the server read /etc or another tenant's files."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from registry.artifacts import ArtifactError


class OutsideImportRoot(Exception):
    """The path leads outside the import root; the message says so without naming the root."""


def import_dir(path: str) -> Path:
    """The directory `path` (relative to the import root, or absolute inside it) names, resolved.
    Raises OutsideImportRoot for one that leads outside, ArtifactError for one that cannot be read.
    Whether it is a model directory is the artifact checks' to say (artifacts.validate_source_dir)."""
    root = Path(settings.ARTIFACT_IMPORT_ROOT).resolve()
    if "\x00" in path:
        raise OutsideImportRoot("the path holds a NUL character")
    try:
        resolved = (root / path).resolve()  # an absolute `path` replaces the root: checked like any other
    except (OSError, RuntimeError) as exc:  # a loop of symbolic links
        raise ArtifactError(f"{path!r} cannot be resolved: {exc}") from None
    if resolved == root or not resolved.is_relative_to(root):
        raise OutsideImportRoot(f"{path!r} is not a directory under the import root")
    try:
        resolved.is_dir()  # raises for a name too long, say; a missing one is the artifact checks' to refuse
    except OSError as exc:
        raise ArtifactError(f"{path!r} cannot be read: {exc.strerror}") from None
    return resolved
