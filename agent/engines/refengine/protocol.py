"""OpenAI request schemas and the response shapes vLLM and OpenAI use (JSON and SSE chunks)."""

from __future__ import annotations

import time
import uuid
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.holder.kvledger import (  # noqa: F401 - the engine's side of the headers
    KV_HEADER,
    KV_KEPT_HEADER,
    REQUEST_HEADER,
    RESUME_HEADER,
)


class Prefill(StrEnum):
    """How a request's prompt goes through the model: its `prefill` field, a Pitstop extension
    (absent: chunked)."""

    # --prefill-chunk tokens a forward call, the last prompt token alone: a greedy request
    # continued from prompt + its first k tokens (a resume) then yields exactly the tokens of
    # the uninterrupted run (the default; 1 token a call unless --prefill-chunk says more).
    CHUNKED = "chunked"
    # The whole prompt in one forward call whose last logits pick the first token, as vLLM
    # prefills: one read of every weight instead of one per prompt token (the canary's way).
    ONE_PASS = "one_pass"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    # Clients send fields we do not use (user, presence_penalty...): ignore, like vLLM.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=1, description="the reference engine makes one choice")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    prefill: Prefill = Prefill.CHUNKED

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by the reference engine")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported by the reference engine")
        return self

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("prompt: the reference engine takes one prompt per request")
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported by the reference engine")
        return self


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, status: int, err_type: str = "BadRequestError",
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, as vLLM sends it."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def completion_choice(text: str, finish: str | None, stop_reason: str | int | None,
                      token_ids: list[int] | None, prompt_ids: list[int] | None) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    return choice


def chat_choice(message_or_delta: dict[str, Any], finish: str | None,
                stop_reason: str | int | None, token_ids: list[int] | None,
                stream: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta" if stream else "message": message_or_delta,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def envelope(rid: str, model: str, chat: bool, stream: bool, choices: list[dict[str, Any]],
             created: int | None = None, **extra: Any) -> dict[str, Any]:
    """The top level of a response or an SSE chunk."""
    obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    body: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
    }
    body.update(extra)
    return body
