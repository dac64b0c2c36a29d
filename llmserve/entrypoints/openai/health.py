"""The body of GET /health: `{"status": "healthy", "state": "ready"}` with 200 once the engine is ready,
else 503 with the state, the reason and an OpenAI-style `error` (states: engine/health.py)."""

from __future__ import annotations

from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.health import HealthState
from llmserve.entrypoints.openai.protocol import ErrorInfo, _Response


class HealthResponse(_Response):
    status: str  # "healthy", or the state that keeps the server from serving
    state: str  # starting, warming, ready, stalled, restarting, stopping
    reason: str | None = None
    error: ErrorInfo | None = None  # for clients that read every non-2xx body as an OpenAI error


def health_of(engine: AsyncLLM) -> tuple[HealthResponse, int]:
    """The body and status /health answers for this engine now."""
    state, reason = engine.health.state, engine.health.reason
    if state.serving and engine.failure is not None:  # a dead rank, not restarted (no supervision)
        state, reason = HealthState.STOPPING, engine.failure
    elif state.serving and not engine.is_running:
        state, reason = HealthState.STOPPING, "the engine has stopped"
    if state is HealthState.READY:
        return HealthResponse(status="healthy", state=state.value), 200
    return unhealthy(state, reason), 503


def unhealthy(state: HealthState, reason: str) -> HealthResponse:
    """The 503 body of a state other than ready."""
    error = ErrorInfo(message=f"the server is {state.value}: {reason}", type="server_error", code="503")
    return HealthResponse(status=state.value, state=state.value, reason=reason, error=error)
