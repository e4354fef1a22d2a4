"""The web pages, in-process over the fake scheduler: what each serves and under which headers, that
their scripts can never run model text (no inline script, no HTML sinks), and --no-web-ui. A real
browser drives them in tests/integration/test_web_ui.py."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from crane_mp.frontend.webui import routes

STATIC = Path(routes.__file__).with_name("static")


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.script_bodies: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.script_bodies.append(data)


def _tags(html: str) -> _Tags:
    parser = _Tags()
    parser.feed(html)
    return parser


@pytest.mark.parametrize("path", ["/", "/status"])
async def test_pages_are_served_with_a_policy_that_runs_only_their_own_files(frontend, path):
    client, _, _ = frontend
    response = await client.get(path)
    assert response.status == 200 and response.content_type == "text/html"
    policy = response.headers["Content-Security-Policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["script-src"] == "'self'" and directives["default-src"] == "'none'"
    assert "unsafe" not in policy and directives["connect-src"] == "'self'"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    page = _tags(await response.text())
    assert not page.script_bodies  # no inline script
    for tag, attrs in page.tags:
        assert not [name for name in attrs if name.startswith("on")], (tag, attrs)  # no inline handlers
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            assert not value.lower().startswith("javascript:")
            if value.startswith("/ui/"):  # every file a page names is served, with its type
                asset = await client.get(value)
                assert asset.status == 200, value
                assert asset.content_type in ("text/javascript", "text/css"), value
                assert asset.headers["Content-Security-Policy"] == policy
    scripts = [attrs["src"] for tag, attrs in page.tags if tag == "script"]
    assert scripts and all(src.startswith("/ui/") for src in scripts)


def test_scripts_never_put_text_into_html():
    """Model text is untrusted: the scripts build text nodes, never parse strings as HTML or code."""
    sinks = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|"
                       r"setTimeout\(\s*['\"`]|DOMParser|createContextualFragment")
    for script in STATIC.glob("*.js"):
        assert not sinks.findall(script.read_text()), script.name


async def test_unknown_files_and_paths_out_of_the_folder_are_404(frontend):
    client, _, _ = frontend
    for path in ("/ui/nothing.js", "/ui/..%2Froutes.py", "/ui/%2e%2e%2f__init__.py", "/ui/routes.py"):
        response = await client.get(path)
        assert response.status == 404, path


@pytest.mark.parametrize("server_args", [{"api_key": "secret"}])
async def test_pages_need_no_key_and_the_api_still_does(frontend):
    client, _, _ = frontend
    assert (await client.get("/")).status == 200
    assert (await client.get("/ui/chat.js")).status == 200
    assert (await client.get("/v1/models")).status == 401
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer secret"})).status == 200


@pytest.mark.parametrize("server_args", [{"web_ui": False}])
async def test_no_web_ui_serves_no_pages(frontend):
    client, _, _ = frontend
    for path in ("/", "/status", "/ui/chat.js"):
        assert (await client.get(path)).status == 404, path
    assert (await client.get("/v1/models")).status == 200


def test_the_flag_turns_the_pages_off():
    from crane_mp.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["--model-path", "m"]).no_web_ui is False
    assert parser.parse_args(["--model-path", "m", "--no-web-ui"]).no_web_ui is True
