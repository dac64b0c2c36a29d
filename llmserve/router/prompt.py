"""A request's prompt as the replica will see it, and the chained hashes of its full blocks.

The body is parsed with the server's own request models and tokenized with the same tokenizer and
chat template (model_loader/tokenizer.py), then hashed with the engine's `hash_block`, so the hashes
are the very keys of the replica's prefix cache (a LoRA adapter's request with the adapter's key in
its first block, from the replicas' /server_info, docs/lora.md). A body the server would reject, and
a route with no prompt (/tokenize, /detokenize), gets no hashes: the router sends it on anyway (to the
least loaded replica) and the replica answers, with the precise error where there is one.
"""

from __future__ import annotations

from collections.abc import Mapping

import pydantic

from llmserve.core.prefix_cache import hash_block
from llmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerateRequest,
    ResponsesRequest,
)
from llmserve.model_loader.tokenizer import Tokenizer

_ADAPTER_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def block_hashes(token_ids: list[int], block_size: int, lora_key: bytes = b"") -> list[bytes]:
    """The engine's chained hashes of the full blocks of `token_ids` (PrefixCache.block_hashes);
    `lora_key`: the request's LoRA adapter's, mixed into the first block's as the engine does."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        hashes.append(hash_block(hashes[-1], block) if hashes else hash_block(b"", block, lora_key))
    return hashes


class PromptHasher:
    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size

    def hashes(self, path: str, body: object, lora_keys: Mapping[str, bytes] | None = None) -> list[bytes]:
        """Block hashes of the (first) prompt of a body of a route that has one; else none.
        `lora_keys`: the replicas' adapters' prefix-cache keys by name (/server_info), for a body
        whose `model` names one."""
        try:
            token_ids = self._token_ids(path, body)
        except (pydantic.ValidationError, ValueError):
            return []
        # the routes whose `model` may name an adapter (/v1/generate and embeddings run the base model)
        model = body.get("model") if isinstance(body, dict) and path in _ADAPTER_ROUTES else None
        key = (lora_keys or {}).get(model, b"") if isinstance(model, str) else b""
        return block_hashes(token_ids, self.block_size, key)

    def _token_ids(self, path: str, body: object) -> list[int]:
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate(body)
            return self.tokenizer.apply_chat_template(chat.template_messages(), chat.add_generation_prompt)
        if path == "/v1/responses":  # rendered as a chat (serving_responses.py)
            messages = ResponsesRequest.model_validate(body).template_messages()
            return self.tokenizer.apply_chat_template(messages, True)
        if path == "/v1/completions":
            prompt = CompletionRequest.model_validate(body).prompts()[0]
        elif path == "/v1/embeddings":
            prompt = EmbeddingRequest.model_validate(body).inputs()[0]
        elif path == "/v1/generate":
            prompt = GenerateRequest.model_validate(body).prompt
        else:
            return []
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
