"""HTTP answers while the model loads and warms up, so that `starting` and `warming` are states a probe
can read, not a refused connection: serve.py binds the port first and the app (uvicorn) runs only
once the engine is ready.

A small stdlib HTTP server on the already-bound socket answers every request with 503: /health with
the engine's state (`starting`, then `warming`: engine/health.py) in the app's body (health.py), any
other path with an OpenAI-style error. It stops before uvicorn takes the socket over; connections made
meanwhile wait in the listen backlog for uvicorn.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading

from llmserve.engine.health import EngineHealth, HealthState

_POLL_SECONDS = 0.05  # how soon `stop` returns: this delays the app's start by at most this much


def _body(path: str, health: EngineHealth) -> bytes:
    state, reason = health.state.value, health.reason
    if health.state not in (HealthState.STARTING, HealthState.WARMING):  # ready: the app takes over now
        state, reason = HealthState.STARTING.value, "the server's app is starting"
    message = f"the server is {state}: {reason}; retry shortly"
    error = {"message": message, "type": "server_error", "param": None, "code": "503"}
    if path.split("?", 1)[0] == "/health":
        return json.dumps({"status": state, "state": state, "reason": reason, "error": error}).encode()
    return json.dumps({"error": error}).encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def _answer(self) -> None:
        body = _body(self.path, self.server.health)
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Retry-After", "1")
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _answer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass  # probes every second would flood the log


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048  # uvicorn's backlog: connections wait there for the app
    health: EngineHealth  # what /health reports

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up mid-answer: nothing to report (the stdlib prints a traceback)


class StartupResponder:
    """Answers on `sock` from `start` until `stop`; the socket stays open for the app."""

    def __init__(self, sock: socket.socket) -> None:
        self._server = _Server(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self._server.socket.close()  # its own unbound socket: the server's bound one replaces it
        self._server.socket = sock
        self._server.health = EngineHealth()  # starting, until `start` is given the engine's
        self._thread: threading.Thread | None = None

    def start(self, health: EngineHealth | None = None) -> None:
        """Answer from `health`'s state (starting, then warming) until `stop`."""
        if health is not None:
            self._server.health = health
        self._server.server_activate()  # listen()
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(_POLL_SECONDS,),
            name="llmserve-startup-responder",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()  # returns once serve_forever has; the socket is not closed
            self._thread.join()
            self._thread = None
