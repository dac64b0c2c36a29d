"""`<think>...</think>` split off generated text into `reasoning`, incrementally (the same parser serves a
stream fed each delta and a plain response fed the whole text), under vLLM's `--reasoning-parser` names:

- `deepseek_r1`: the output is reasoning until `</think>` (a leading `<think>` dropped), then content;
  without `</think>` all of it is reasoning (DeepSeek-R1's template opens `<think>` in the prompt).
- `qwen3`: reasoning only when the output opens with `<think>`, or the prompt ends with an open
  `<think>` (Qwen3 thinking templates); without either, all of it is content (`enable_thinking: false`
  writes an empty think block into the prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _held(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could start `tag`."""
    return next(
        (size for size in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-size:])), 0
    )


class ReasoningParser:
    name = ""
    opens_by_default = False  # the output starts inside the reasoning without a `<think>` of its own

    def __init__(self, prompt_text: str = "") -> None:
        self.text = ""
        self.pos = 0
        # None: not known yet whether the output opens with <think>; then "reasoning" or "content"
        self.state: str | None = "reasoning" if prompt_text.rstrip().endswith(START) else None
        self.opened = self.state == "reasoning"

    def feed(self, delta: str) -> ReasoningDelta:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        return self._advance(final=True)

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of the whole output."""
        self.text += text
        out = self.finish()
        return (out.reasoning if self.opened else None), out.content

    def _advance(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self.state is None:
            head = self.text.lstrip()
            if head.startswith(START):
                self.state, self.opened = "reasoning", True
                self.pos = self.text.index(START) + len(START)
            elif START.startswith(head) and not final:
                return out  # may still become <think>
            elif self.opens_by_default:
                self.state, self.opened = "reasoning", True
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.text.find(END, self.pos)
            if end == -1:
                keep = 0 if final else _held(self.text[self.pos :], END)
                out.reasoning = self.text[self.pos : len(self.text) - keep]
                self.pos = len(self.text) - keep
                return out
            out.reasoning = self.text[self.pos : end]
            self.pos = end + len(END)
            self.state = "content"
        out.content = self.text[self.pos :]
        self.pos = len(self.text)
        return out


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_by_default = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
}


def count_reasoning_tokens(
    token_ids: Sequence[int], decode: Callable[[list[int]], str], parser: ReasoningParser | None
) -> int:
    """How many of an output's tokens are its reasoning (the Responses API's `reasoning_tokens`): those
    up to the one that completes `</think>`, the tags' own tokens included; all of them when it never
    comes; none when `parser` (fed the whole output) found no reasoning. The end is found by bisection
    over the decoded prefixes, since a prefix that holds `</think>` keeps it as it grows."""
    if parser is None or not parser.opened:
        return 0
    ids = list(token_ids)
    if END not in decode(ids):
        return len(ids)
    low, high = 0, len(ids)  # the shortest prefix that holds END has `high` tokens
    while low < high:
        middle = (low + high) // 2
        if END in decode(ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return high
