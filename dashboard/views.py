"""The dashboard's pages and its two kinds of action. Thin: check access, call one selector or service,
render. Staff only: anonymous visitors go to the login page, signed-in non-staff users get 403.

The overview and model pages are async: they read the replicas from the data plane's runtime, which
lives on the server's event loop. Their database reads and the template run in a worker thread."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from inspect import iscoroutinefunction
from typing import Any
from urllib.parse import urlencode

from asgiref.sync import sync_to_async
from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from audit import actors
from audit.models import AuditEntry
from audit.selectors import AuditQuery, audit_entries, audit_row
from dashboard import charts, selectors
from dashboard.finders import PLOTLY_JS_PATH, PLOTLY_VERSION
from registry.services import api_key_create
from rollouts import selectors as rollout_selectors
from rollouts import services as rollout_services
from rollouts.steps import DeploymentError

View = Callable[..., Any]


def _check_staff(request: HttpRequest, user: Any) -> HttpResponse | None:
    if not user.is_authenticated:
        return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
    if not (user.is_active and user.is_staff):
        raise PermissionDenied("the dashboard is for staff")
    return None


def staff_required(view: View) -> View:
    """Anonymous: redirect to the login page (with ?next=). Authenticated but not staff: 403."""
    if iscoroutinefunction(view):

        @wraps(view)
        async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            refusal = _check_staff(request, await request.auser())
            return refusal or await view(request, *args, **kwargs)

        return async_wrapper

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        refusal = _check_staff(request, request.user)
        return refusal or view(request, *args, **kwargs)

    return wrapper


class ActionForm(forms.Form):
    reason = forms.CharField(max_length=500, required=False)


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=63, required=False)


class AuditFilterForm(forms.Form):
    object_type = forms.ChoiceField(
        choices=[("", "Any"), *AuditEntry.ObjectType.choices], required=False, label="Object"
    )
    actor = forms.CharField(max_length=200, required=False)
    since = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"}), label="From"
    )
    until = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"}), label="Until"
    )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        since, until = cleaned.get("since"), cleaned.get("until")
        if since is not None and until is not None and until <= since:
            raise forms.ValidationError("The range must end after it starts.")
        return cleaned


AUDIT_PAGE_SIZE = 50


def _actor(request: HttpRequest) -> str:
    return actors.staff(request.user)  # as the API and the admin name staff actors


def _plotly() -> dict[str, str]:
    return {"plotly_js": PLOTLY_JS_PATH, "plotly_version": PLOTLY_VERSION}


# --- overview and model pages (async: replicas come from the runtime) -----------------------------------


@staff_required
async def overview(request: HttpRequest) -> HttpResponse:
    replicas, complete = await selectors.page_replicas()
    page = await sync_to_async(selectors.overview)(replicas=replicas)
    live = {
        "ws_path": "/dashboard/ws/overview/",
        "deployment_url": reverse("dashboard:deployment", args=[0]),  # the script puts the id in
    }
    context = {**page, "live": live, "replicas_incomplete": not complete}
    return await sync_to_async(render)(request, "dashboard/overview.html", context)


def _model_page(request: HttpRequest, model_name: str, replicas: list[Any], complete: bool) -> HttpResponse:
    model = selectors.model_get(name=model_name)
    if model is None:
        raise Http404(f"no model {model_name!r}")
    chart = charts.chart_range(request.GET.get("range"))
    page = selectors.model_page(model=model, chart=chart, replicas=replicas)
    context = {
        "page": page,
        "ranges": charts.RANGES.values(),
        "chart": chart,
        "config": {
            **page,
            "charts": charts.CHARTS,
            "tier_charts": charts.TIER_CHARTS,
            "tier_dash": charts.TIER_DASH,
            "batch_bins": [label for label, _ in charts.BATCH_BINS],
            "fill_bins": [label for label, _ in charts.QUEUE_WAIT_BINS],
            "live_interval_s": selectors.LIVE_INTERVAL_S,
            "ws_path": f"/dashboard/ws/models/{model.name}/?"
            + urlencode({"range": chart.key, "versions": ",".join(page["charted"])}),
        },
        "replicas_incomplete": not complete,
        **_plotly(),
    }
    return render(request, "dashboard/model.html", context)


@staff_required
async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    replicas, complete = await selectors.page_replicas()
    return await sync_to_async(_model_page)(request, model, replicas, complete)


# --- rollouts ----------------------------------------------------------------------------------------


@staff_required
def rollouts(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/rollouts.html", {"deployments": selectors.deployments_list()})


@staff_required
def model_rollout(request: HttpRequest, model: str) -> HttpResponse:
    """The model's current deployment (in flight, else the latest)."""
    found = selectors.model_get(name=model)
    if found is None:
        raise Http404(f"no model {model!r}")
    deployment = selectors.latest_deployment(model=found)
    if deployment is None:
        return render(request, "dashboard/rollout_none.html", {"model": found.name})
    return redirect("dashboard:deployment", deployment_id=deployment.pk)


@staff_required
def deployment_detail(request: HttpRequest, deployment_id: int) -> HttpResponse:
    page = selectors.deployment_page(deployment_id=deployment_id)
    if page is None:
        raise Http404(f"no deployment {deployment_id}")
    live = {
        "deployment_id": deployment_id,
        "state": page["deployment"]["state"],
        "ws_path": f"/dashboard/ws/models/{page['model']}/?points=0",
    }
    return render(request, "dashboard/deployment.html", {**page, "live": live})


def _deployment_action(request: HttpRequest, deployment_id: int, action: str) -> HttpResponse:
    deployment = rollout_selectors.deployment_get(deployment_id=deployment_id, with_events=False)
    if deployment is None:
        raise Http404(f"no deployment {deployment_id}")
    form = ActionForm(request.POST)
    reason = form.cleaned_data["reason"] if form.is_valid() else ""
    service = {
        "rollback": rollout_services.deployment_rollback,
        "promote": rollout_services.deployment_promote,
    }[action]
    try:
        done = service(deployment=deployment, actor=_actor(request), reason=reason)
    except DeploymentError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Deployment {done.pk}: {done.get_state_display()}.")
    return redirect("dashboard:deployment", deployment_id=deployment_id)


@staff_required
@require_POST
def deployment_rollback(request: HttpRequest, deployment_id: int) -> HttpResponse:
    return _deployment_action(request, deployment_id, "rollback")


@staff_required
@require_POST
def deployment_promote(request: HttpRequest, deployment_id: int) -> HttpResponse:
    return _deployment_action(request, deployment_id, "promote")


# --- tenants -----------------------------------------------------------------------------------------


def _tenants(
    request: HttpRequest, *, new_key: dict[str, Any] | None = None, status: int = 200
) -> HttpResponse:
    context = {**selectors.tenants_page(), "form": ApiKeyForm(), "new_key": new_key}
    response = render(request, "dashboard/tenants.html", context, status=status)
    if new_key is not None:
        response["Cache-Control"] = "no-store"  # the raw key is in this page and nowhere else
    return response


@staff_required
def tenants(request: HttpRequest) -> HttpResponse:
    return _tenants(request)


@staff_required
@require_POST
def tenant_api_key_create(request: HttpRequest, tenant_id: int) -> HttpResponse:
    """Create a key and show it in this response only: it is stored as a hash, never in the session."""
    tenant = selectors.tenant_get(tenant_id=tenant_id)
    if tenant is None:
        raise Http404(f"no tenant {tenant_id}")
    form = ApiKeyForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Key name: " + " ".join(form.errors.get("name", ["invalid"])))
        return _tenants(request, status=400)
    api_key, raw_key = api_key_create(tenant=tenant, name=form.cleaned_data["name"], actor=_actor(request))
    return _tenants(request, new_key={"tenant": tenant.name, "name": api_key.name, "raw": raw_key})


# --- the audit log -----------------------------------------------------------------------------------


@staff_required
def audit_log(request: HttpRequest) -> HttpResponse:
    """Every recorded change, newest first, filtered by object type, actor and time range (UTC)."""
    form = AuditFilterForm(request.GET)
    if not form.is_valid():
        context = {"form": form, "rows": [], "page": None, "query_string": ""}
        return render(request, "dashboard/audit.html", context, status=400)
    query = AuditQuery(**form.cleaned_data)
    page = Paginator(audit_entries(query), AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    filters = {k: v for k, v in request.GET.items() if k != "page" and v}
    context = {
        "form": form,
        "rows": [audit_row(entry) for entry in page.object_list],
        "page": page,
        "query_string": urlencode(filters),
    }
    return render(request, "dashboard/audit.html", context)
