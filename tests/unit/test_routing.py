"""Routes are declared once (routing.py); the router, the load-shedding gate, the API-key exemptions and
/openapi.json all derive from the declarations, and errors.py alone maps why a request failed to HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

from crane_mp.frontend.api_routes import ROUTES
from crane_mp.frontend.openapi import api as openapi_api, build_openapi
from crane_mp.frontend.web.errors import GenerationError
from crane_mp.frontend.web.routing import admin_paths, open_paths
from crane_mp.frontend.webui import routes as webui
from crane_mp.protocol import ErrorKind


def test_each_method_and_path_is_declared_once():
    pairs = [(route.method, route.path) for route in [*ROUTES, *openapi_api.routes]]
    assert len(pairs) == len(set(pairs))


def test_openapi_documents_every_declared_route_but_aliases():
    doc = build_openapi(1000, 2048, "m", 16)
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    declared = {(r.method, r.path.replace("{model_id:.+}", "{model_id}")) for r in ROUTES if r.summary}
    assert documented == declared
    assert ("post", "/tokenize") not in documented and ("get", "/get_model_info") not in documented
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    assert "401" in doc["paths"]["/v1/completions"]["post"]["responses"]


def test_gate_and_key_exemptions_come_from_the_declarations():
    assert {route.path for route in ROUTES if route.generation} == {
        "/v1/chat/completions", "/v1/completions", "/generate", "/v1/embeddings", "/v1/responses", "/v1/messages",
        "/v1/rerank", "/rerank", "/v2/rerank", "/score", "/v1/score", "/v1/audio/transcriptions",
        "/v1/audio/translations"}
    # Probes, and the web pages with their files (whose API calls need the key).
    static = Path(webui.__file__).with_name("static")
    assert open_paths(ROUTES) == {"/health", "/", "/status", *(f"/ui/{p.name}" for p in static.iterdir())}
    assert admin_paths(ROUTES) == {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/flush_cache", "/abort_request",
                                   "/sleep", "/wake_up", "/update_weights_from_disk"}


@pytest.mark.parametrize("kind, status", [(ErrorKind.INVALID, 400), (ErrorKind.OVERLOADED, 429),
                                          (ErrorKind.INTERNAL, 500), (ErrorKind.TIMEOUT, 408),
                                          (ErrorKind.UNAVAILABLE, 503)])
def test_every_error_kind_has_its_http_status(kind, status):
    assert GenerationError("why", kind).status == status


def test_no_error_kind_is_left_unmapped():
    statuses = {GenerationError("why", kind).status for kind in ErrorKind}
    assert len(statuses) == len(ErrorKind)
