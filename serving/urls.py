from django.urls import path

from serving import api, openai_api

urlpatterns = [
    path("models/<str:model>/infer", api.infer, name="infer"),
    path("completions", openai_api.completions, name="completions"),
    path("chat/completions", openai_api.chat_completions, name="chat-completions"),
    path("embeddings", openai_api.embeddings, name="embeddings"),
]
