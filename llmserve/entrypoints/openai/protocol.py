"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are validated strictly (a string where a number belongs is a 400, not silently coerced,
and so is a non-finite number) but unknown fields are ignored, as OpenAI does. A field OpenAI defines
that this server does not implement is declared `Unsupported`, so setting it is a 400 naming it
rather than silently ignored (docs/server.md classes every such field). Value ranges that only make
sense together with the model (max_tokens against the context length) are checked by the serving
code.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)
from pydantic_core import CoreSchema, core_schema

from llmserve.outputs import SpecDecodeStats
from llmserve.sampling_params import MAX_LOGPROBS, SamplingParams
from llmserve.structured.params import StructuredOutputsParams

MAX_N = 16  # choices per prompt
MAX_STOP_SEQUENCES = 16
MAX_TIMEOUT_SECONDS = 86400.0  # a request's `timeout`
MAX_SPECULATIVE_TOKENS = 15  # a verify span of K + 1 stays within the in-place attention kernel
MAX_SEED = 2**63 - 1 - MAX_N  # parallel samples use seed + index, which must stay an int64
MAX_PRIORITY = 2**63 - 1  # an int64: the scheduler adds it to a float, which a huger int overflows
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class _Request(BaseModel):
    # Python's JSON parser takes Infinity and NaN literals; they must fail as the field they are in
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        """Many clients send null for "not set"; an optional field then takes its default."""
        if value is None and info.field_name is not None:
            field = cls.model_fields[info.field_name]
            if not field.is_required():
                return field.get_default(call_default_factory=True)
        return value

    @classmethod
    def unsupported_fields(cls) -> set[str]:
        return {
            name
            for name, field in cls.model_fields.items()
            if any(isinstance(meta, Unsupported) for meta in field.metadata)
        }


class Unsupported:
    """Marks a field OpenAI defines that this server does not implement (`Annotated[Any, Unsupported()]`).

    Null, or one of the `off` values (those that ask for nothing, like `tool_choice: "none"`), is
    accepted; any other value is a 400 naming the field.
    """

    def __init__(self, *off: Any) -> None:
        self.off = off

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value: Any) -> Any:
        if value is not None and value not in self.off:
            accepted = " or ".join(["null", *(json.dumps(off) for off in self.off)])
            raise ValueError(f"is not supported by this server (only {accepted} is accepted)")
        return value


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ----------------------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# -- shared request fields -------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """response_format's json_schema: OpenAI's structured outputs."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(_Request):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` extra body: exactly one of these constraints."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)  # -1 or 0: disabled
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] = Field(default_factory=list)  # validated into a list
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # lower runs first when the server uses --scheduling-policy priority
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    # drafts per step for this request when the server speculates (None: the server's K; 0: off)
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    # vLLM's extra fields
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, prompt_logprobs: int | None, info: ValidationInfo) -> int | None:
        if prompt_logprobs is not None and info.data.get("stream"):  # as vLLM
            raise ValueError("is not available when stream is true")
        return prompt_logprobs

    # seconds: refused (429) if the predicted queue wait exceeds it, aborted (408) when it passes
    timeout: float | None = Field(None, gt=0.0, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False)
    # latency targets the scheduler plans this request for (None: the server's --ttft/tpot-target-ms)
    ttft_target_ms: float | None = Field(None, gt=0.0, le=1e3 * MAX_TIMEOUT_SECONDS, allow_inf_nan=False)
    tpot_target_ms: float | None = Field(None, gt=0.0, le=1e3 * MAX_TIMEOUT_SECONDS, allow_inf_nan=False)
    # structured outputs (llmserve/structured): OpenAI's response_format, vLLM's extra body and its
    # older guided_* names; at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not (token.isascii() and token.isdigit()):  # "²".isdigit() is true too
                raise ValueError(f"keys must be token ids, got {token[:20]!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {token}")
        return bias

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str]) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if not all(stops):
            raise ValueError("stop sequences must not be empty")
        if any(_LONE_SURROGATE.search(stop) for stop in stops):  # generated text never holds one
            raise ValueError("stop sequences must be valid Unicode (no lone UTF-16 surrogates)")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("is only allowed when stream is true")
        return options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field that set the token limit, for error messages."""
        return "max_tokens"

    def requested_logprobs(self) -> int | None:
        """Top-N logprobs to compute per generated token; None when not asked for."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """Top-N logprobs to compute per prompt token; None when not asked for."""
        return self.prompt_logprobs

    def num_candidates(self) -> int:
        """Completions the engine generates per prompt (best_of: more than are returned)."""
        return self.n

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine parameters; `max_tokens` is resolved by the caller against the context length."""
        return SamplingParams(
            n=self.num_candidates(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            num_speculative_tokens=self.num_speculative_tokens,
            logit_bias=self.logit_bias,  # keys become ints in SamplingParams
            stop_token_ids=list(self.stop_token_ids),
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.requested_prompt_logprobs(),
            structured_outputs=structured_outputs_params(self),
            ttft_target_ms=self.ttft_target_ms,
            tpot_target_ms=self.tpot_target_ms,
        )

    def structured_outputs_field(self) -> str | None:
        """The field that asked for structured outputs, for error messages."""
        return next((name for name in STRUCTURED_OUTPUT_FIELDS if _asks_for_structure(self, name)), None)


STRUCTURED_OUTPUT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _asks_for_structure(request: _SamplingRequest, name: str) -> bool:
    value = getattr(request, name)
    if name == "response_format":
        return value is not None and value.type != "text"
    return value is not None


def structured_outputs_params(request: _SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint; ValueError (starting with the field's name) if malformed or doubled."""
    asked = [name for name in STRUCTURED_OUTPUT_FIELDS if _asks_for_structure(request, name)]
    if len(asked) > 1:
        raise ValueError(f"{asked[1]} cannot be combined with {asked[0]}: set one structured-output field")
    if not asked:
        return None
    name = asked[0]
    value = getattr(request, name)
    try:
        if name == "response_format":
            if value.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if value.json_schema is None or value.json_schema.schema_ is None:
                raise ValueError("type json_schema needs json_schema.schema")
            return StructuredOutputsParams.from_schema(value.json_schema.schema_)
        if name == "structured_outputs":
            fields = value.model_dump(exclude_none=True)
            if fields.get("json_object") is False:
                del fields["json_object"]
            if "json_" in fields:
                schema = fields.pop("json_")
                if fields:
                    raise ValueError(f"sets json and {', '.join(fields)}: set exactly one")
                return StructuredOutputsParams.from_schema(schema)
            kwargs = {k: tuple(v) if k == "choice" else v for k, v in fields.items()}
            return StructuredOutputsParams(**kwargs)
        if name == "guided_json":
            return StructuredOutputsParams.from_schema(value)
        if name == "guided_choice":
            return StructuredOutputsParams(choice=tuple(value))
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value})
    except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{name} {error}") from error


# -- /v1/completions -------------------------------------------------------------------------------

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # candidates per prompt, the n likeliest returned
    suffix: str | None = None  # text after the completion: a fill-in-the-middle prompt (fim.py)

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is None:
            return None
        if best_of < info.data.get("n", 1):
            raise ValueError(f"must be >= n ({info.data.get('n')}), got {best_of}")
        if best_of > info.data.get("n", 1) and info.data.get("stream"):
            raise ValueError("greater than n cannot be streamed: the best are known only at the end")
        return best_of

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("must not be an empty list")
        return prompt

    def requested_logprobs(self) -> int | None:
        if self.ranks_candidates and self.logprobs is None:
            return 0  # ranking needs each candidate's cumulative logprob, not shown to the client
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """echo with logprobs reports the prompt's tokens too, with as many alternatives."""
        echoed = self.logprobs if self.echo else None
        asked = [n for n in (self.prompt_logprobs, echoed) if n is not None]
        return max(asked) if asked else None

    @property
    def ranks_candidates(self) -> bool:
        return self.best_of is not None and self.best_of > self.n

    def num_candidates(self) -> int:
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's entry for one prompt token's alternative (`prompt_logprobs`, keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobList = list[dict[str, PromptLogprob] | None]  # per prompt token; the first has None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: PromptLogprobList | None = Field(default=None, exclude_if=lambda value: value is None)


class SpeculativeUsage(_Response):
    """llmserve's extension of `usage` (speculative decoding; absent when nothing was drafted)."""

    num_drafts: int  # verification steps with at least one draft
    num_draft_tokens: int  # draft tokens proposed and verified
    num_accepted_tokens: int  # of which the target accepted
    acceptance_rate: float  # accepted / proposed
    mean_accepted_length: float  # tokens gained per verification step (accepted + 1)

    @classmethod
    def of(cls, stats: SpecDecodeStats) -> SpeculativeUsage:
        return cls(
            num_drafts=stats.num_drafts,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            acceptance_rate=stats.acceptance_rate,
            mean_accepted_length=stats.mean_accepted_length,
        )


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at first scheduling


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    speculative: SpeculativeUsage | None = Field(default=None, exclude_if=lambda value: value is None)

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
        speculative: SpecDecodeStats | None = None,
    ) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            speculative=SpeculativeUsage.of(speculative) if speculative and speculative.num_drafts else None,
        )


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions --------------------------------------------------------------------------


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallText(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(_Request):
    """A call in an earlier assistant turn of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallText


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns only
    # tool turns only, and required there: the call this is the result of
    tool_call_id: str | None = Field(None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _check_content_parts(cls, content: Any) -> Any:
        return refuse_non_text_parts(content, ("text",))

    @field_validator("tool_calls")
    @classmethod
    def _check_tool_calls(cls, calls: list | None, info: ValidationInfo) -> list | None:
        if calls is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _check_tool_call_id(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if call_id is not None and info.data.get("role") != "tool":
            raise ValueError("only tool messages have a tool_call_id")
        if call_id is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return call_id

    def to_template_message(self) -> dict[str, Any]:
        """The dict chat templates expect: {role, content} (text parts joined by newlines), plus an
        assistant turn's tool_calls (arguments parsed, as templates index them) or a tool turn's id."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments_value(call)},
                }
                for call in self.tool_calls
            ]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id or ""
        return message


def refuse_non_text_parts(content: Any, text_types: tuple[str, ...]) -> Any:
    """`content` unchanged, or ValueError naming its first image, audio or file part: every model
    here is served for text (Gemma 3 from 4B up reads images too, but not here yet)."""
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in text_types:
            raise ValueError(
                f"content parts of type {kind!r} are not supported: the model is served for text "
                f"only (send parts of type {text_types[0]!r})"
            )
    return content


def _arguments_value(call: AssistantToolCall) -> Any:
    """The arguments as an object when they are JSON (templates write them out), else the text."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(_Request):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the schema is enforced under tool_choice required or named either way


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    functions: Annotated[Any, Unsupported([])] = None
    function_call: Annotated[Any, Unsupported("none")] = None
    modalities: Annotated[Any, Unsupported(["text"])] = None
    audio: Annotated[Any, Unsupported()] = None
    prediction: Annotated[Any, Unsupported()] = None
    web_search_options: Annotated[Any, Unsupported()] = None
    moderation: Annotated[Any, Unsupported()] = None
    reasoning_effort: Annotated[Any, Unsupported()] = None
    verbosity: Annotated[Any, Unsupported()] = None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return top_logprobs

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template_message() for message in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (unset fields left out)."""
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_choice_value(self) -> str | dict[str, str] | None:
        """tool_choice as a string, or a named function as {"name": ...}."""
        choice = self.tool_choice
        return {"name": choice.function.name} if isinstance(choice, NamedToolChoice) else choice

    def structured_outputs_field(self) -> str | None:
        forced = self.tools and (
            self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        )
        return super().structured_outputs_field() or ("tool_choice" if forced else None)


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ChatToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    # vLLM's field for split-off reasoning (older vLLM named it reasoning_content); set by --reasoning-parser
    reasoning: str | None = Field(default=None, exclude_if=lambda value: value is None)
    tool_calls: list[ChatToolCall] | None = Field(default=None, exclude_if=lambda value: value is None)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobList | None = Field(default=None, exclude_if=lambda value: value is None)


class _Sparse(_Response):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    """A streamed piece of a call: index, id, type and name first, then fragments of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        """A delta carries only what changed: the role once, then content pieces, finally nothing."""
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# -- /v1/models, /tokenize, /detokenize -------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmserve"
    max_model_len: int
    root: str | None = None  # the model's own name, or a LoRA adapter's path (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model; None for the model itself


class LoadLoRAAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)  # a PEFT directory on the server's machine


class UnloadLoRAAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """Either `prompt` (plain text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, validate_default=True)
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _check_one_input(cls, messages: list[ChatMessage] | None, info: ValidationInfo) -> list | None:
        if (messages is None) == (info.data.get("prompt") is None):
            raise ValueError("give exactly one of prompt and messages")
        return messages


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


# -- /v1/embeddings ---------------------------------------------------------------------------------


class EmbeddingRequest(_Request):
    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # only the model's own size: no Matryoshka truncation
    user: str | None = None
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @field_validator("input")
    @classmethod
    def _check_input(cls, prompt: Prompt) -> Prompt:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("must not be an empty list")
        return prompt

    def inputs(self) -> list[str | list[int]]:
        """The input field as a list of inputs (text or token ids)."""
        prompt = self.input
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64: the little-endian float32 bytes, as OpenAI sends them
    index: int


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# -- /v1/responses (stateless) ----------------------------------------------------------------------


class ResponseInputText(_Request):
    type: Literal["input_text", "output_text", "text"]  # output_text: an earlier assistant turn's
    text: str


class ResponseInputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponseInputText]

    @field_validator("content", mode="before")
    @classmethod
    def _check_content_parts(cls, content: Any) -> Any:
        return refuse_non_text_parts(content, ("input_text", "output_text", "text"))

    def to_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ResponseFunctionCallInput(_Request):
    """An earlier turn's call, as the Responses API returned it."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponseFunctionCallOutputInput(_Request):
    """The result of a call, sent back by the client."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


ResponseInputItem = ResponseInputMessage | ResponseFunctionCallInput | ResponseFunctionCallOutputInput


class ResponseTool(_Request):
    """A function tool; the Responses API has its fields beside `type` (chat nests them)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": function}


class ResponseNamedToolChoice(_Request):
    type: Literal["function"]
    name: str


class ResponseTextFormat(_Request):
    """The Responses API's output format: json_schema's fields sit beside `type` (chat nests them)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way

    def to_structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        return StructuredOutputsParams.from_schema(self.schema_)


class ResponseTextConfig(_Request):
    format: ResponseTextFormat | None = None
    verbosity: Annotated[Any, Unsupported()] = None


STORED_RESPONSES = "stored responses are not supported: this server keeps no state between requests"


class ResponsesRequest(_Request):
    """OpenAI's Responses API without stored state: every request carries its whole conversation."""

    model: str | None = None
    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    text: ResponseTextConfig | None = None
    store: bool = False  # true asks the server to keep the response: refused (STORED_RESPONSES)
    previous_response_id: str | None = None  # refused (STORED_RESPONSES)
    tools: list[ResponseTool] = Field(default_factory=list)  # function tools only
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    user: str | None = None  # no effect, as on chat
    metadata: dict[str, str] | None = None  # no effect: nothing is stored
    parallel_tool_calls: bool = True
    truncation: Annotated[Any, Unsupported("disabled")] = None
    background: Annotated[Any, Unsupported(False)] = None
    conversation: Annotated[Any, Unsupported()] = None
    include: Annotated[Any, Unsupported([])] = None
    max_tool_calls: Annotated[Any, Unsupported()] = None
    prompt: Annotated[Any, Unsupported()] = None
    reasoning: Annotated[Any, Unsupported()] = None
    top_logprobs: Annotated[Any, Unsupported(0)] = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: str | list[ResponseInputItem]) -> str | list[ResponseInputItem]:
        if isinstance(value, list) and not value:
            raise ValueError("must not be an empty list")
        return value

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template: the instructions as a system message first, calls
        as assistant turns' tool_calls (consecutive ones in one turn), their outputs as tool turns."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, ResponseInputMessage):
                messages.append(item.to_template_message())
            elif isinstance(item, ResponseFunctionCallOutputInput):
                messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
            else:
                call = AssistantToolCall(
                    id=item.call_id, function=FunctionCallText(name=item.name, arguments=item.arguments)
                )
                call_dict = {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": _arguments_value(call)},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call_dict)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call_dict]})
        return messages

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.to_chat_tool() for tool in self.tools]

    def tool_dicts_flat(self) -> list[dict[str, Any]]:
        """The tools as the Responses API echoes them."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_choice_value(self) -> str | dict[str, str] | None:
        choice = self.tool_choice
        return {"name": choice.name} if isinstance(choice, ResponseNamedToolChoice) else choice

    # what ServerContext.sampling_params reads of a request
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_output_tokens"

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        text_format = self.text.format if self.text is not None else None
        structured = None if text_format is None else text_format.to_structured_outputs()
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=max_tokens,
            structured_outputs=structured,
        )

    def structured_outputs_field(self) -> str | None:
        """The field that asked for structured outputs, for error messages."""
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            return "text"
        forced = self.tools and (
            self.tool_choice == "required" or isinstance(self.tool_choice, ResponseNamedToolChoice)
        )
        return "tool_choice" if forced else None


class ResponseOutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseFunctionCall(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(_Response):
    """The reply's reasoning, split off by --reasoning-parser."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int

    @classmethod
    def of(cls, usage: UsageInfo, reasoning_tokens: int = 0) -> ResponseUsage:
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details={
                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                "cache_write_tokens": 0,
            },
            output_tokens=usage.completion_tokens,
            output_tokens_details={"reasoning_tokens": reasoning_tokens},
            total_tokens=usage.total_tokens,
        )


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    output: list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionCall] = Field(
        default_factory=list
    )
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, str] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = False
    previous_response_id: None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None


# -- /v1/generate (the design's own minimal route) ---------------------------------------------------


class GenerateRequest(_Request):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    stream: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=max_tokens)


class GenerateResponse(_Response):
    text: str
    tokens_generated: int
    latency_ms: float  # from the request's arrival to its last token
    tokens_per_second: float  # tokens_generated over that latency
    finish_reason: FinishReason | None = None


class GenerateChunk(_Response):
    """One streamed event: a piece of text, or (done) the final counts with the whole text."""

    text: str
    tokens_generated: int
    done: bool = False
    latency_ms: float | None = Field(default=None, exclude_if=lambda value: value is None)
    tokens_per_second: float | None = Field(default=None, exclude_if=lambda value: value is None)
    finish_reason: FinishReason | None = Field(default=None, exclude_if=lambda value: value is None)
