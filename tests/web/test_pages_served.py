"""The pages and their files are served from the package, with nothing fetched from elsewhere."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from llmserve.entrypoints.openai.api_server import build_app
from llmserve.entrypoints.openai.web import STATIC_DIR
from tests.entrypoints.test_server_units import FailingEngine


async def get(app, path: str, headers: dict | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path, headers=headers)


def test_pages_and_assets_are_served_with_their_types():
    app = build_app(FailingEngine(fail_after=None), "m", api_key="k")
    for path, media in [
        ("/", "text/html"),
        ("/dashboard", "text/html"),
        ("/static/playground.js", "text/javascript"),
        ("/static/dashboard.js", "text/javascript"),
        ("/static/style.css", "text/css"),
    ]:
        response = asyncio.run(get(app, path))  # open without the API key: the page asks for it
        assert response.status_code == 200, path
        assert response.headers["content-type"].startswith(media), path
    missing = asyncio.run(get(app, "/static/../api_server.py"))
    assert missing.status_code == 404 and "error" in missing.json()
    assert asyncio.run(get(app, "/static/nothing.js")).status_code == 404


def test_pages_load_nothing_from_another_origin_and_never_write_html():
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), path.name
        assert "@import" not in text and 'fetch("http' not in text, path.name
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text and "document.write" not in text


def test_json_metrics_are_behind_the_key_and_the_dashboard_stats_are_not():
    app = build_app(FailingEngine(fail_after=None), "m", api_key="k")
    assert asyncio.run(get(app, "/v1/metrics")).status_code == 401
    body = asyncio.run(get(app, "/v1/metrics", {"Authorization": "Bearer k"})).json()
    assert body["model"] == "m" and body["total_requests"] == 0
    stats = asyncio.run(get(app, "/dashboard/stats")).json()
    assert stats["summary"]["num_requests_running"] == 0 and stats["points"] == []


def test_a_missing_browser_fails_with_the_install_command(monkeypatch):
    from tests.web import browser

    monkeypatch.setattr(browser, "DRIVER", "/nonexistent/chromedriver")
    with pytest.raises(pytest.fail.Exception, match=r"apt-get install -y chromium chromium-driver"):
        browser.start_browser()
