"""The server's pages and their JSON: the playground at `/`, the dashboard at `/dashboard`, the JSON
metrics summary `GET /v1/metrics`, the dashboard's series `GET /dashboard/stats` and the playground's
`GET /playground/config` (whether the API routes need a key).

The pages are static files shipped in the package (entrypoints/openai/static/: plain HTML, CSS and
JavaScript, no build step, nothing fetched from elsewhere); they talk to the server through its public
API only. Both JSON routes read the metrics registry behind `/metrics` (metrics/summary.py), so the
page, the JSON and Prometheus show the same numbers.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, JSONResponse, Response

from llmserve.metrics.history import MetricsHistory
from llmserve.metrics.summary import Scrape, summary

STATIC_DIR = Path(__file__).parent / "static"
_PAGES = {"/": "playground.html", "/dashboard": "dashboard.html"}
_ASSETS = {"playground.js", "dashboard.js", "style.css"}
_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}

routes = APIRouter()


def _metrics(raw_request: Request):
    return raw_request.app.state.llmserve.metrics  # metrics/prometheus.py:PrometheusMetrics


def _history(raw_request: Request) -> MetricsHistory:
    state = raw_request.app.state
    if not hasattr(state, "metrics_history"):
        registry = _metrics(raw_request).registry
        state.metrics_history = MetricsHistory(lambda: Scrape(registry.collect()))
    return state.metrics_history


@routes.get("/v1/metrics")
async def metrics_summary(raw_request: Request) -> Response:
    """Totals since start-up, averages over finished requests and the engine's state now."""
    metrics = _metrics(raw_request)
    return JSONResponse({"model": metrics.model_name, **summary(Scrape(metrics.registry.collect()))})


@routes.get("/dashboard/stats")
async def dashboard_stats(raw_request: Request) -> Response:
    """The dashboard's series: one point per second it has been watched, up to five minutes."""
    metrics = _metrics(raw_request)
    return JSONResponse(
        {
            "model": metrics.model_name,
            "summary": summary(Scrape(metrics.registry.collect())),
            "points": _history(raw_request).points(),
        }
    )


@routes.get("/playground/config")
async def playground_config(raw_request: Request) -> Response:
    """What the page must know before its first API call: whether to ask for a key."""
    return JSONResponse({"api_key_required": getattr(raw_request.app.state, "api_key_required", False)})


# pages and their files, not API operations: left out of the OpenAPI schema (and of its fuzzing)
@routes.get("/", include_in_schema=False)
async def playground() -> Response:
    return _static(_PAGES["/"])


@routes.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return _static(_PAGES["/dashboard"])


@routes.get("/static/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in _ASSETS:
        return JSONResponse(
            {
                "error": {
                    "message": f"no such file: {name}",
                    "type": "not_found_error",
                    "param": None,
                    "code": None,
                }
            },
            404,
        )
    return _static(name)


def _static(name: str) -> Response:
    path = STATIC_DIR / name
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})
