"""Tools and tool turns put into a conversation whose chat template knows nothing of them.

A template that reads a `tools` variable renders tools, assistant `tool_calls` and `tool` messages
itself. For one that does not (the default SmolLM2's), the conversation is rewritten before the
template sees it, in the tool-call parser's own format:
- the tools are listed in a system message (appended to the first one, or a new first one), with the
  call format the parser reads (FALLBACK_PROMPTS);
- an assistant turn's calls are written into its content in that format;
- `tool` messages become a user turn holding `<tool_response>` blocks (consecutive ones merged).
"""

from __future__ import annotations

import functools
import json
from typing import Any

FALLBACK_PROMPTS = {
    "hermes": (
        "You may call one or more functions to assist with the user query. The functions are listed "
        "within <tools></tools> as JSON:\n<tools>\n{tools}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments within "
        "<tool_call></tool_call> tags:\n<tool_call>\n"
        '{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
    ),
    "llama3_json": (
        "You may call functions to assist with the user query. The functions are listed below as "
        "JSON:\n{tools}\n\nTo call a function, reply with only a JSON object "
        '{{"name": <function-name>, "parameters": <arguments-object>}}; join several calls with "; ".'
    ),
}
CHOICE_HINTS = {
    "required": "You must call at least one function.",
    "named": "You must call the function {name}.",
    "single": "Call at most one function.",
}


@functools.lru_cache(maxsize=16)
def template_reads_tools(template: str) -> bool:
    """Whether a Jinja chat template uses the `tools` variable."""
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return "tools" in template  # transformers' own environment has extensions; a plain look


def tools_prompt(tools: list[dict], parser: str, choice: str | None, parallel: bool) -> str:
    """The fallback system text listing the tools; `choice` is "required", a function's name or None."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    text = FALLBACK_PROMPTS[parser].format(tools=listing)
    if choice == "required":
        text += "\n" + CHOICE_HINTS["required"]
    elif choice is not None:
        text += "\n" + CHOICE_HINTS["named"].format(name=choice)
    if not parallel:
        text += "\n" + CHOICE_HINTS["single"]
    return text


def rewrite_for_plain_template(
    messages: list[dict[str, Any]], parser: str, system_text: str | None
) -> list[dict[str, str]]:
    """The conversation as plain {role, content} turns, the tools listed in `system_text` (if any)."""
    out: list[dict[str, str]] = []
    for message in messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": "1"})
        elif message.get("tool_calls"):
            calls = format_calls(message["tool_calls"], parser)
            content = message["content"]
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    for message in out:
        message.pop("tool_results", None)
    if system_text:
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{system_text}" if out[0]["content"] else system_text
        else:
            out.insert(0, {"role": "system", "content": system_text})
    return out


def format_calls(calls: list[dict[str, Any]], parser: str) -> str:
    """An assistant turn's calls written as the model would have written them."""
    objects = []
    for call in calls:
        function = call["function"]
        arguments = function["arguments"]
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        key = "parameters" if parser == "llama3_json" else "arguments"
        objects.append(f'{{"name": {json.dumps(function["name"])}, "{key}": {text}}}')
    if parser == "llama3_json":
        return "; ".join(objects)
    return "\n".join(f"<tool_call>\n{text}\n</tool_call>" for text in objects)
