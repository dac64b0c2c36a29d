"""The Responses API's output items for a reply split by an OutputParser (chat_tools.py): a `reasoning`
item, the `message` item and one `function_call` item per call, and the typed events that stream them.

Each item is added when its first piece comes, so items stream (and the final response lists them)
in the order they started: response.output_item.added, then its pieces
(response.reasoning_text.delta, response.output_text.delta after response.content_part.added,
response.function_call_arguments.delta), and at the end its done events and
response.output_item.done.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from llmserve.entrypoints.openai.chat_tools import ChoiceDelta
from llmserve.entrypoints.openai.protocol import (
    ResponseFunctionCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningText,
)


class Events:
    """Typed server-sent events with OpenAI's growing sequence number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def function_call(
    call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed"
) -> ResponseFunctionCall:
    return ResponseFunctionCall(
        id=item_id or f"fc_{uuid.uuid4().hex}", call_id=call_id, name=name, arguments=arguments, status=status
    )


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> ResponseReasoningItem:
    content = [ResponseReasoningText(text=text)] if text else []
    return ResponseReasoningItem(id=item_id or f"rs_{uuid.uuid4().hex}", content=content, status=status)


class StreamedItems:
    """The output items of a streamed reply, in the order they started."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.indexes: dict[str, int] = {}  # item id -> output index
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []  # per call: item id, call id, name, arguments

    def add(self, piece: ChoiceDelta) -> list[str]:
        out = []
        if piece.reasoning:
            if self.reasoning_id not in self.indexes:
                out.append(
                    self._added(self.reasoning_id, reasoning_item("", self.reasoning_id, "in_progress"))
                )
            self.reasoning.append(piece.reasoning)
            out.append(self._send("response.reasoning_text.delta", self.reasoning_id, delta=piece.reasoning))
        if piece.parsed.content:
            if self.message_id not in self.indexes:
                out += self._open_message()
            self.text.append(piece.parsed.content)
            out.append(
                self._send(
                    "response.output_text.delta", self.message_id, delta=piece.parsed.content, logprobs=[]
                )
            )
        for delta in piece.parsed.tool_calls:
            if delta.id is not None:
                call = {"id": f"fc_{uuid.uuid4().hex}", "call_id": delta.id, "name": delta.name or ""}
                self.calls.append({**call, "arguments": ""})
                item = function_call(delta.id, call["name"], "", call["id"], "in_progress")
                out.append(self._added(call["id"], item))
            call = self.calls[delta.index]
            if delta.arguments:
                call["arguments"] += delta.arguments
                out.append(
                    self.events.send(
                        "response.function_call_arguments.delta",
                        item_id=call["id"],
                        output_index=self.indexes[call["id"]],
                        delta=delta.arguments,
                    )
                )
        return out

    def close(self) -> list[str]:
        """The done events of every item; a reply with nothing in it gets an empty message."""
        out = self._open_message() if not self.indexes else []
        if self.reasoning_id in self.indexes:
            text = "".join(self.reasoning)
            out.append(self._send("response.reasoning_text.done", self.reasoning_id, text=text))
            out.append(self._done(self.reasoning_id, reasoning_item(text, self.reasoning_id)))
        if self.message_id in self.indexes:
            text = "".join(self.text)
            out.append(self._send("response.output_text.done", self.message_id, text=text, logprobs=[]))
            part = ResponseOutputText(text=text)
            out.append(
                self._send("response.content_part.done", self.message_id, part=part.model_dump(mode="json"))
            )
            out.append(
                self._done(
                    self.message_id,
                    ResponseOutputMessage(id=self.message_id, status="completed", content=[part]),
                )
            )
        for call in self.calls:
            out.append(
                self.events.send(
                    "response.function_call_arguments.done",
                    item_id=call["id"],
                    output_index=self.indexes[call["id"]],
                    name=call["name"],
                    arguments=call["arguments"],
                )
            )
            out.append(
                self._done(
                    call["id"], function_call(call["call_id"], call["name"], call["arguments"], call["id"])
                )
            )
        return out

    def output(self, status: str) -> list[Any]:
        """The final response's items, in the order they were streamed."""
        items: dict[str, Any] = {}
        if self.reasoning_id in self.indexes:
            items[self.reasoning_id] = reasoning_item("".join(self.reasoning), self.reasoning_id)
        if self.message_id in self.indexes:
            text = ResponseOutputText(text="".join(self.text))
            items[self.message_id] = ResponseOutputMessage(id=self.message_id, status=status, content=[text])
        for call in self.calls:
            items[call["id"]] = function_call(call["call_id"], call["name"], call["arguments"], call["id"])
        return sorted(items.values(), key=lambda item: self.indexes[item.id])

    def _open_message(self) -> list[str]:
        empty = ResponseOutputMessage(id=self.message_id, status="in_progress", content=[])
        part = ResponseOutputText(text="").model_dump(mode="json")
        return [
            self._added(self.message_id, empty),
            self._send("response.content_part.added", self.message_id, part=part),
        ]

    def _added(self, item_id: str, item: Any) -> str:
        self.indexes[item_id] = len(self.indexes)
        return self.events.send(
            "response.output_item.added",
            output_index=self.indexes[item_id],
            item=item.model_dump(mode="json"),
        )

    def _done(self, item_id: str, item: Any) -> str:
        return self.events.send(
            "response.output_item.done", output_index=self.indexes[item_id], item=item.model_dump(mode="json")
        )

    def _send(self, kind: str, item_id: str, **fields: Any) -> str:
        """An event about a part of an item: its text or reasoning (content index 0)."""
        return self.events.send(
            kind, item_id=item_id, output_index=self.indexes[item_id], content_index=0, **fields
        )
