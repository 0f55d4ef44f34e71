"""plotly.js from the copy the `plotly` Python package ships, as the static file PLOTLY_JS_PATH.

No CDN and no vendored copy in the repository: a staticfiles finder exposes that one file, so the
embedded server (ASGIStaticFilesHandler) serves it and `collectstatic` copies it for production. The
plotly package's version goes in the URL (templates: `?v=`), so caches can keep it for a long time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import plotly
from django.contrib.staticfiles.finders import BaseFinder
from django.core.checks import Error
from django.core.files.storage import FileSystemStorage

PLOTLY_JS_PATH = "dashboard/vendor/plotly.min.js"
PLOTLY_VERSION = plotly.__version__
_PACKAGE_DATA = Path(plotly.__file__).resolve().parent / "package_data"
_FILE_NAME = "plotly.min.js"


class PlotlyJsFinder(BaseFinder):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage = FileSystemStorage(location=str(_PACKAGE_DATA))
        # collectstatic writes a file at `prefix/path` (as FileSystemFinder does for prefixed dirs).
        self.storage.prefix = str(Path(PLOTLY_JS_PATH).parent)  # type: ignore[attr-defined]

    def check(self, **kwargs: Any) -> list[Error]:
        if not (_PACKAGE_DATA / _FILE_NAME).is_file():
            return [
                Error(
                    f"plotly.js not found at {_PACKAGE_DATA / _FILE_NAME}",
                    hint="Install the plotly package (a dependency in pyproject.toml).",
                    id="dashboard.E001",
                )
            ]
        return []

    def find(self, path: str, find_all: bool = False, **kwargs: Any) -> str | list[str]:
        if path == PLOTLY_JS_PATH and (_PACKAGE_DATA / _FILE_NAME).is_file():
            match = str(_PACKAGE_DATA / _FILE_NAME)
            return [match] if find_all else match
        return []  # what Django's own finders answer for "not here", with or without find_all

    def list(self, ignore_patterns: Any) -> Any:
        if (_PACKAGE_DATA / _FILE_NAME).is_file():
            yield _FILE_NAME, self.storage
