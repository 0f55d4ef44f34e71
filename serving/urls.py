from django.urls import path

from serving.edge import infer_api as api
from serving.edge import openai_api

urlpatterns = [
    path("models/<str:model>/infer", api.infer, name="infer"),
    path("completions", openai_api.completions, name="completions"),
    path("chat/completions", openai_api.chat_completions, name="chat-completions"),
    path("embeddings", openai_api.embeddings, name="embeddings"),
]
