"""The page at /: where a new user is, and where to go from there (the dashboard, the API's schema, the
health probes). Public, and it shows nothing of any tenant: the start banner points a browser here, and
a bare 404 there said nothing."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_safe


@require_safe
def landing(request: HttpRequest) -> HttpResponse:
    return render(
        request, "dashboard/landing.html", {"base_url": request.build_absolute_uri("/").rstrip("/")}
    )
