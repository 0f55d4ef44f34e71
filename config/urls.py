from django.contrib import admin
from django.urls import include, path
from django.views.generic.base import RedirectView
from drf_spectacular.views import SpectacularAPIView

from dashboard.landing import landing
from serving.edge import probes
from serving.telemetry.prometheus import metrics_view

urlpatterns = [
    path("", landing, name="landing"),
    path("healthz", probes.healthz, name="healthz"),
    path("readyz", probes.readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("v1/schema", SpectacularAPIView.as_view(), name="schema"),
    path("v1/", include("serving.urls")),
    path("v1/", include("rollouts.urls")),  # before registry.urls: it extends /v1/models/{model}/versions
    path("v1/", include("registry.urls")),
    path("admin/", admin.site.urls),
    path("dashboard/", include("dashboard.urls")),
    # Pages without an icon link (the admin's) make browsers ask for /favicon.ico; answer, not 404.
    path("favicon.ico", RedirectView.as_view(url="/static/dashboard/favicon.svg", permanent=True)),
]

# Under /v1/ every answer is JSON in the one error shape (registry/errors.py), unknown paths and failures
# included; the dashboard and the admin keep Django's pages.
handler400 = "registry.errors.bad_request"  # a Host outside ALLOWED_HOSTS, say
handler404 = "registry.errors.not_found"
handler500 = "registry.errors.server_error"
