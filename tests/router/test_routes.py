"""Without a model: the router serves every route a replica serves, every address the playground and
dashboard pages call, and hashes the prompt of each route that has one as the replica will see it."""

from __future__ import annotations

import re

from fastapi.routing import APIRoute

from llmserve.entrypoints.openai import api_server, web
from llmserve.router import app
from llmserve.router.prompt import PromptHasher, block_hashes

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, router"}]
TEXT = "a prompt long enough to fill a few blocks of four tokens"


def _routes(*routers) -> set[tuple[str, str]]:
    return {
        (method, route.path)
        for router in routers
        for route in router.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }


def test_the_router_serves_every_route_a_replica_serves():
    replica = _routes(api_server.router, web.routes)
    assert ("POST", "/v1/responses") in replica  # the replica's routes are read, not an empty set
    assert replica - _routes(app.routes) == set()


def test_every_address_the_pages_call_is_a_router_route():
    served = {path for _, path in _routes(app.routes)}
    called = set()
    for name in ("playground.js", "dashboard.js", "playground.html", "dashboard.html"):
        text = (web.STATIC_DIR / name).read_text()
        called |= set(re.findall(r'(?:fetch|stream)\("(/[^"]*)"', text))
        called |= set(re.findall(r'(?:href|src)="(/[^"]*)"', text))
    assert {"/server_info", "/playground/config", "/v1/chat/completions", "/dashboard/stats"} <= called
    assets = {path for path in called if path.startswith("/static/")}
    assert called - assets <= served and "/static/{name}" in served


class CharTokenizer:
    """One token per character; the chat template writes each message as `role: content` lines."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))


def test_each_route_with_a_prompt_is_hashed_as_its_replica_renders_it():
    hasher = PromptHasher(CharTokenizer(), 4)
    text = block_hashes(CharTokenizer().encode(TEXT), 4)
    chat = block_hashes(CharTokenizer().apply_chat_template(MESSAGES, True), 4)
    assert hasher.hashes("/v1/completions", {"prompt": TEXT}) == text
    assert hasher.hashes("/v1/embeddings", {"input": [TEXT, "another"]}) == text  # the first input
    assert hasher.hashes("/v1/generate", {"prompt": TEXT}) == text
    assert hasher.hashes("/v1/chat/completions", {"messages": MESSAGES}) == chat
    # the instructions become the system message, as on the replica
    responses = {"input": MESSAGES[1]["content"], "instructions": MESSAGES[0]["content"]}
    assert hasher.hashes("/v1/responses", responses) == chat
    assert hasher.hashes("/tokenize", {"prompt": TEXT}) == []  # no prompt to place: the least loaded
    # an adapter's request: its key (the replicas' /server_info) in the first block, as the engine's
    keys = {"sql": b"lora:sql"}
    adapter = hasher.hashes("/v1/completions", {"prompt": TEXT, "model": "sql"}, keys)
    assert adapter == block_hashes(CharTokenizer().encode(TEXT), 4, b"lora:sql") and adapter != text
    assert hasher.hashes("/v1/completions", {"prompt": TEXT, "model": "base"}, keys) == text
    assert hasher.hashes("/v1/generate", {"prompt": TEXT, "model": "sql"}, keys) == text  # the base model
    assert hasher.hashes("/v1/generate", {"prompt": ""}) == []  # the replica's 400 is the answer
