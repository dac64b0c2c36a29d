"""Prefill/decode disaggregation, the router's side: a new request's prompt goes to a prefill instance
first, then the whole request to a decode instance, which finds the prompt's blocks as prefix hits.

    client --> router --(1) the request with max_tokens 1, not streamed--> prefill instance (kv_producer)
                  |                                   its prompt's full blocks --> connector
                  '--(2) the request as sent---------> decode instance (kv_consumer) --> stream back

Step 1 is vLLM's disaggregated proxy's: the prefill instance runs the prompt and one token, and its
engine sends the prompt's full KV blocks (worker/kv_transfer.py) before it answers. Step 2 is the
router's usual forwarding (proxy.py) over the decode instances. The prefill is an optimisation, never a
dependency: a prefill instance that cannot be reached, errs, or does not answer within
`--prefill-timeout` is logged and the decode instance computes the prompt itself (a cold prefill), so
the answer is the same and the request never hangs on it; a block the prefill sent only in part is a
miss there, computed again (each block file is checked on read). Only the completion routes with a
prompt the router hashes take step 1: /v1/completions and /v1/chat/completions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

import httpx

from llmserve.router.replica import Replica

logger = logging.getLogger("llmserve.router")

PREFILL_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# a prefill generates one token, alone and whole: what would make it stream, sample more or wait longer
_DROPPED = ("stream", "stream_options", "n", "best_of", "min_tokens", "max_completion_tokens")


def prefill_request(request: dict) -> dict:
    """The request a prefill instance runs: the same prompt and parameters, one token, not streamed."""
    body = {key: value for key, value in request.items() if key not in _DROPPED}
    body["max_tokens"] = 1
    return body


class PrefillStage:
    def __init__(
        self,
        client: httpx.AsyncClient,
        replicas: Sequence[Replica],
        timeout_seconds: float,
        on_prefill: Callable[[str, bool], None] = lambda url, prefilled: None,
    ) -> None:
        self.client = client
        self.replicas = replicas  # the prefill instances
        self.timeout = httpx.Timeout(timeout_seconds)  # each of connect, read and write
        self.on_prefill = on_prefill  # metrics: (the instance's URL, "" for none; whether it prefilled)

    async def run(self, path: str, request: object, headers: dict[str, str]) -> bool:
        """Prefill the request's prompt on the least loaded healthy prefill instance; whether one did
        (False: the decode instance computes the prompt; the reason is logged)."""
        if path not in PREFILL_PATHS or not isinstance(request, dict):
            return False
        replica = min((r for r in self.replicas if r.healthy), key=lambda r: r.load, default=None)
        if replica is None:
            return self._skip("", "no prefill instance is healthy")
        body = json.dumps(prefill_request(request)).encode()
        replica.in_flight += 1
        try:
            response = await self.client.post(
                replica.url + path, content=body, headers=headers, timeout=self.timeout
            )
        except httpx.TransportError as error:  # unreachable, died mid-request, or past the timeout
            replica.mark_failed(str(error) or type(error).__name__)
            return self._skip(replica.url, f"{type(error).__name__} {error}")
        finally:
            replica.in_flight -= 1
        if response.status_code != 200:
            return self._skip(replica.url, f"HTTP {response.status_code}")
        self.on_prefill(replica.url, True)
        return True

    def _skip(self, url: str, reason: str) -> bool:
        self.on_prefill(url, False)
        logger.warning("prefill skipped (%s %s); the decode instance computes the prompt", url, reason)
        return False
