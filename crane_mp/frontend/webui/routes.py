"""The chat page at / and the status page at /status, with their scripts and styles under /ui/.

The files are the package's own (static/), read once at import: no CDN, nothing fetched at run time.
They are served without the API key, as llama-server serves its page; the pages ask for the key and
send it with their API calls, which keep the API's rules. Every answer carries a Content-Security-Policy
that runs only these files' scripts (no inline script, no eval) and lets the pages reach only this
server: model text is untrusted, and the scripts only ever put it into text nodes.
`--no-web-ui` leaves every one of these routes out (404, as on a server without pages).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from crane_mp.frontend.web.routing import RouteTable

api = RouteTable()

_CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
_FILES = {path.name: path.read_bytes() for path in sorted(Path(__file__).with_name("static").iterdir())
          if path.suffix in _CONTENT_TYPES}
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                           "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def _mounted(config) -> bool:
    return config.web_ui


def _file(name: str) -> web.Response:
    return web.Response(body=_FILES[name], content_type=_CONTENT_TYPES[Path(name).suffix], charset="utf-8",
                        headers=_HEADERS)


def _serve(name: str):
    async def page_file(request: web.Request) -> web.Response:
        return _file(name)

    return page_file


@api.add("get", "/", open=True, mounted=_mounted)
async def chat_page(request: web.Request) -> web.Response:
    return _file("index.html")


@api.add("get", "/status", open=True, mounted=_mounted)
async def status_page(request: web.Request) -> web.Response:
    return _file("status.html")


# One route per file (no path parameter): nothing but these files can be asked for, and each is an open
# path the API-key check knows by name.
for _name in _FILES:
    api.add("get", f"/ui/{_name}", open=True, mounted=_mounted)(_serve(_name))
