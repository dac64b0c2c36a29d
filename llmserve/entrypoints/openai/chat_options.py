"""The server's chat settings as the handlers use them: the template override's text, and how tool calls
and reasoning are parsed out of generated text (the flags: config/server.py, ChatConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmserve.config.server import ChatConfig, ReasoningParserName, ToolCallParserName


@dataclass(frozen=True)
class ChatOptions:
    chat_template: str | None = None
    """a Jinja chat template that replaces the model's own (`--chat-template FILE`)"""
    tool_call_parser: ToolCallParserName = "hermes"
    """the tool-call format models are told to use (when their template does not) and that is parsed"""
    reasoning_parser: ReasoningParserName | None = None
    """split `<think>` reasoning off into `message.reasoning`; None: reasoning stays in the content"""

    @classmethod
    def load(cls, config: ChatConfig) -> ChatOptions:
        """The options `config` names, its template file read."""
        template = None
        if config.chat_template is not None:
            try:
                template = Path(config.chat_template).read_text()
            except OSError as error:
                raise ValueError(
                    f"--chat-template {config.chat_template}: cannot read it ({error.strerror})"
                ) from None
        return cls(template, config.tool_call_parser, config.reasoning_parser)
