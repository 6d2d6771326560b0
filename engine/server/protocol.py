"""Request and response bodies of the OpenAI API, as pydantic models.

Requests are as lenient as vLLM's: a field no model here knows is kept aside (pydantic's extras),
logged and ignored by the server (`unknown_fields` finds them; `--strict-api` makes them a 400 naming the
first). Fields that vLLM honours and Pagoda cannot (`UNSUPPORTED_FIELDS`) are always a 400, since ignoring
them would silently change the answer. Fields that current OpenAI SDKs send as hints (`HINT_FIELDS`: they
never change the output) are accepted and ignored. Bounds on fields keep a fuzzer (or a typo) from reaching
the engine with values it cannot honour. docs/api.md lists every field's status.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128
# The schema only keeps logprob counts in an int32; the real limit is the server's --max-logprobs (default
# 20, as vLLM), checked with the request's other sampling values so a server started with more allows more.
LOGPROBS_BOUND = 2**31 - 1
MAX_LOGIT_BIAS = 300  # entries; OpenAI's own limit
# Accepted and ignored: hints that do not change what is generated (logged once each, at debug level).
HINT_FIELDS = (
    "user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "reasoning_effort", "guided_decoding_backend",
)  # fmt: skip
# vLLM honours these and Pagoda does not: a 400 even without --strict-api (ignoring them changes the answer).
UNSUPPORTED_FIELDS = (
    "lora_request", "bad_words", "allowed_token_ids", "logits_processors", "spaces_between_special_tokens",
    "return_tokens_as_token_ids", "guided_whitespace_pattern", "chat_template", "structural_tag",
)  # fmt: skip

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class StrictModel(BaseModel):
    """A request body (or a part of one): unknown fields are kept aside as extras for the server to judge."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def unknown_fields(value: Any, path: str = "") -> list[str]:
    """The paths (`stream_options.foo`, `messages[0].content[1].bar`) of the fields that no request model
    knows, in a parsed request; chat messages and their tool calls take extra keys for the chat template."""
    out: list[str] = []
    if isinstance(value, BaseModel):
        if not isinstance(value, ChatMessage | ToolCallIn):
            out += [f"{path}.{k}" if path else k for k in value.model_extra or {}]
        for name in type(value).model_fields:
            out += unknown_fields(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel | list):
                out += unknown_fields(item, f"{path}[{i}]")
    return out


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(StrictModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (one of them)."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, max_length=1024)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)


class SamplingFields(StrictModel):
    """Fields the two completion endpoints share."""

    model: str | None = Field(None, description="Served model name; omitted means the default model.")
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None, max_length=64)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    seed: Int64 | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    priority: Int64 = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Pagoda extension (extra body): attention sinks for this request; see --kv-eviction.
    kv_eviction: Literal["none", "streaming"] | None = None
    kv_sink_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    kv_window_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Token id (as a string) -> bias added to its logit."
    )
    prompt_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_BOUND)
    # Structured outputs: OpenAI's response_format and vLLM's fields (at most one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=1024)
    guided_grammar: str | None = None
    # vLLM's: keep only the last N prompt tokens (-1: the last max_model_len); None: no truncation.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    # vLLM's prefill/decode handshake (docs/disaggregation.md): do_remote_decode asks a prefill engine to
    # hold the prompt's blocks; do_remote_prefill + remote_* tell a decode engine where to fetch them.
    kv_transfer_params: dict[str, Any] | None = None
    # Hints (HINT_FIELDS): accepted, ignored.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    guided_decoding_backend: str | None = None

    def hints_set(self) -> list[str]:
        return [name for name in HINT_FIELDS if getattr(self, name, None) is not None]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        ..., description="A string, a list of strings, a list of token ids or a list of token-id lists."
    )
    logprobs: int | None = Field(None, ge=0, le=LOGPROBS_BOUND)
    echo: bool = False
    # 0 with echo: prompt scoring (the prompt and its logprobs, nothing generated)
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = Field(None, max_length=0, description="Only empty is supported (no insertion).")


class ContentPart(BaseModel):
    """A part of a message's content: any type parses, so the server can refuse what is not text in plain
    words (this model takes text only) rather than with a parser's message."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(StrictModel):
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template's input: text content, tool calls and ids kept."""
        d: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.name:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)

    def non_text_part(self) -> tuple[int, str] | None:
        """(index, type) of the first content part that is not text, or None."""
        for i, part in enumerate(self.content if isinstance(self.content, list) else []):
            if part.type != "text" or part.text is None:
                return i, part.type
        return None


class FunctionDef(StrictModel):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_BOUND)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = None


class LoadLoRAAdapterRequest(StrictModel):
    """vLLM's body for POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096, description="A PEFT directory on the replica")


class UnloadLoRAAdapterRequest(StrictModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=128)


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # the model's reasoning, where its format separates it (gpt-oss's analysis channel), as vLLM returns it
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
