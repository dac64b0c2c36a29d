"""A request's prompt as the replica will see it, and the chained hashes of its full blocks.

The body is parsed with the server's own request models and tokenized with the same tokenizer and
chat template (model_loader/tokenizer.py), then hashed with the engine's `hash_block`, so the hashes
are the very keys of the replica's prefix cache. A body the server would reject gets no hashes: the
router sends it on anyway and the replica answers with the precise error.
"""

from __future__ import annotations

import pydantic

from llmserve.core.kv_cache_manager import hash_block
from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.model_loader.tokenizer import Tokenizer


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The engine's chained hashes of the full blocks of `token_ids` (KVCacheManager._hashes)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else b"", tuple(token_ids[start : start + block_size])))
    return hashes


class PromptHasher:
    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size

    def hashes(self, path: str, body: object) -> list[bytes]:
        """Block hashes of the (first) prompt of a /v1/completions or /v1/chat/completions body."""
        try:
            token_ids = self._token_ids(path, body)
        except (pydantic.ValidationError, ValueError):
            return []
        return block_hashes(token_ids, self.block_size)

    def _token_ids(self, path: str, body: object) -> list[int]:
        if path.endswith("/chat/completions"):
            chat = ChatCompletionRequest.model_validate(body)
            return self.tokenizer.apply_chat_template(chat.template_messages(), chat.add_generation_prompt)
        prompt = CompletionRequest.model_validate(body).prompts()[0]
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
