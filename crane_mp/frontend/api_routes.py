"""Every API route the frontend serves, gathered from each module's declarations (routing.py). The
app adds these and /openapi.json (openapi.py), which documents them."""

from __future__ import annotations

from crane_mp.frontend import (
    anthropic_routes,
    audio_routes,
    embedding_routes,
    lora_routes,
    management_routes,
    openai_routes,
    responses_routes,
    score_routes,
    sglang_routes,
    tokenize_routes,
)
from crane_mp.frontend.routing import Route

ROUTES: list[Route] = [
    *openai_routes.api.routes,
    *responses_routes.api.routes,
    *anthropic_routes.api.routes,
    *score_routes.api.routes,
    *embedding_routes.api.routes,
    *lora_routes.api.routes,
    *tokenize_routes.api.routes,
    *management_routes.api.routes,
    *sglang_routes.api.routes,
    *audio_routes.api.routes,
]
