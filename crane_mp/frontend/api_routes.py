"""Every API route the frontend serves, gathered from each API folder's declarations (web/routing.py): a
new API is one folder and one line here. The app adds these and /openapi.json (openapi.py), which
documents them."""

from __future__ import annotations

from crane_mp.frontend.anthropic import routes as anthropic
from crane_mp.frontend.audio import routes as audio
from crane_mp.frontend.management import lora, residency, routes as management
from crane_mp.frontend.openai import embeddings, routes as openai, tokenize
from crane_mp.frontend.responses import routes as responses
from crane_mp.frontend.scoring import routes as scoring
from crane_mp.frontend.sglang import routes as sglang
from crane_mp.frontend.web.routing import Route
from crane_mp.frontend.webui import routes as webui

ROUTES: list[Route] = [
    *openai.api.routes,
    *responses.api.routes,
    *anthropic.api.routes,
    *scoring.api.routes,
    *embeddings.api.routes,
    *lora.api.routes,
    *tokenize.api.routes,
    *management.api.routes,
    *residency.api.routes,
    *sglang.api.routes,
    *audio.api.routes,
    *webui.api.routes,
]
