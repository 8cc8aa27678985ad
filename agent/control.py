"""The agent's control socket: how `pitstop` commands reach a running agent."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agent.errors import PitstopError, StatusError

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlServer:
    """POST /<action> with a JSON body; answers JSON. Only this uid can connect (0600).

    Example::

        server = ControlServer(run_dir / "control.sock", {"snapshot": take_snapshot})
        await server.start()
    """

    def __init__(self, path: Path, actions: dict[str, Handler]) -> None:
        self.path = path
        self._actions = actions
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        action = request.match_info["action"]
        handler = self._actions.get(action)
        if handler is None:
            return web.json_response(
                {"error": f"unknown action {action!r}; known: {sorted(self._actions)}"},
                status=404)
        try:
            body = await request.json() if request.can_read_body else {}
            result = await handler(body)
        except PitstopError as e:
            return web.json_response({"error": str(e)}, status=409)
        except (ValueError, TypeError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        return web.json_response(result)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{action}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        old = os.umask(0o177)
        try:
            await web.UnixSite(self._runner, str(self.path)).start()
        finally:
            os.umask(old)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


async def call(path: Path, action: str, body: dict[str, Any] | None = None,
               timeout: float = 900.0) -> dict[str, Any]:
    """Ask the running agent to do `action`; raises with the agent's own error message."""
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(path)),
                timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
                s.post(f"http://agent/{action}", json=body or {}) as r:
            data = json.loads(await r.read())
            refused = r.status >= 400
    except (aiohttp.ClientConnectionError, FileNotFoundError) as e:
        raise StatusError(f"no agent answers on {path}: is `pitstop run` running with this "
                          f"config? ({e})") from e
    # By the status, not by the body: an answer may carry an `error` field of its own (a
    # reload report says why a file was not applied).
    if refused:
        raise PitstopError(f"the agent refused {action}: {data['error']}")
    return data
