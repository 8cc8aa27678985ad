"""Talking to the engine over its Unix socket: health, model list, the canary request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent.errors import EngineError


@dataclass(frozen=True)
class CanaryAnswer:
    """The greedy answer to the canary request: what verification compares. With the
    prompt's logprobs asked for, the top prediction at each prompt position comes first,
    then the generated tokens."""

    text: str
    token_ids: tuple[int, ...]

    @classmethod
    def from_choice(cls, choice: dict[str, Any]) -> CanaryAnswer:
        top = [_top_prediction(pos) for pos in choice.get("prompt_logprobs") or () if pos]
        return cls(text="".join(t for _, t in top) + choice["text"],
                   token_ids=(*(i for i, _ in top), *(choice.get("token_ids") or ())))


def _top_prediction(position: dict[str, dict[str, Any]]) -> tuple[int, str]:
    """The rank-1 token of one prompt position's logprobs (vLLM's `{id: {logprob, rank,
    decoded_token}}`, which also holds the prompt's own token at its rank)."""
    for token_id, lp in position.items():
        if lp.get("rank") == 1:
            return int(token_id), lp.get("decoded_token") or ""
    raise EngineError(f"canary answer's prompt logprobs name no rank-1 token: {position}")


class EngineProbe:
    """HTTP over the engine's Unix socket, every call bounded by a timeout.

    Example::

        async with EngineProbe(sock, timeout=2) as probe:
            await probe.health()
    """

    def __init__(self, socket: Path, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineProbe:
        # A fresh connection each time: a pooled one could outlive the engine it reached.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(self.socket), force_close=True),
            timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, body: dict | None = None,
                       timeout: float | None = None) -> tuple[int, bytes]:
        assert self._session is not None
        t = aiohttp.ClientTimeout(total=timeout or self.timeout)
        try:
            async with self._session.request(
                    method, f"http://engine{path}", json=body, timeout=t) as r:
                return r.status, await r.read()
        except TimeoutError as e:
            raise EngineError(f"engine did not answer {path} within {t.total:.1f}s") from e
        except aiohttp.ClientError as e:
            raise EngineError(f"engine unreachable on {self.socket}: {e}") from e

    async def health(self, path: str = "/health") -> None:
        status, body = await self._request("GET", path)
        if status != 200:
            raise EngineError(f"engine {path} answered {status}: {body[:200]!r}")

    async def control(self, path: str, body: dict | None = None,
                      timeout: float | None = None) -> dict:
        """POST to one of the engine's control endpoints (prepare/resume for snapshots)."""
        status, raw = await self._request("POST", path, body or {}, timeout=timeout)
        if status != 200:
            raise EngineError(f"engine {path} answered {status}: {raw[:300]!r}")
        # Some of vLLM's control endpoints answer 200 with no body.
        return json.loads(raw) if raw.strip() else {}

    async def models(self) -> list[str]:
        status, body = await self._request("GET", "/v1/models")
        if status != 200:
            raise EngineError(f"engine /v1/models answered {status}: {body[:200]!r}")
        return [m["id"] for m in json.loads(body).get("data", [])]

    async def canary(self, model: str, prompt: str, max_tokens: int, timeout: float,
                     fields: dict[str, Any] | None = None) -> CanaryAnswer:
        """The greedy answer; `fields` join the body (the adapter's way to ask for a
        canary method)."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True, **(fields or {})}
        status, raw = await self._request("POST", "/v1/completions", body, timeout=timeout)
        if status != 200:
            raise EngineError(f"canary request answered {status}: {raw[:300]!r}")
        return CanaryAnswer.from_choice(json.loads(raw)["choices"][0])
