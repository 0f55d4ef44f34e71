from django.urls import path

from rollouts import api, traffic_api

urlpatterns = [
    path("deployments", api.DeploymentListView.as_view(), name="deployment-list"),
    path("deployments/<int:deployment_id>", api.DeploymentDetailView.as_view(), name="deployment-detail"),
    path(
        "deployments/<int:deployment_id>/rollback",
        api.DeploymentRollbackView.as_view(),
        name="deployment-rollback",
    ),
    path(
        "deployments/<int:deployment_id>/promote",
        api.DeploymentPromoteView.as_view(),
        name="deployment-promote",
    ),
    path("models/<str:model>/aliases/<str:alias>", traffic_api.AliasView.as_view(), name="model-alias"),
    path("models/<str:model>/traffic", traffic_api.TrafficView.as_view(), name="model-traffic"),
    # Same path as the registry's view, which it extends; config/urls.py includes this module first.
    path("models/<str:model>/versions", api.ModelVersionListView.as_view(), name="model-versions-rollouts"),
]
