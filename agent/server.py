"""The local HTTP endpoint (loopback; reached through ``ssh -L 8421:localhost:8421``).

``GET /healthz``, ``GET /status`` (JSON) are open; ``POST /stop`` needs the bearer token from the
state directory (mode 0600), so another user on the box cannot end someone's run.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

log = logging.getLogger("agent.server")

StatusFn = Callable[[], dict[str, Any]]
ActionFn = Callable[[], Awaitable[dict[str, Any]]]


class StatusServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str,
        status: StatusFn,
        actions: dict[str, ActionFn],
    ) -> None:
        self.host = host
        self.port = port
        self._token = token
        self._status = status
        self._actions = actions
        self._runner: web.AppRunner | None = None
        self.bound_port: int | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/status", self._get_status)
        for name in self._actions:
            app.router.add_post(f"/{name}", self._make_action(name))
        return app

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = int(sockets[0].getsockname()[1]) if sockets else self.port
        log.info("http listening on http://%s:%d", self.host, self.bound_port)
        return self.bound_port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _get_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self._token.encode()
        )

    def _make_action(self, name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            if not self._authorized(request):
                return web.json_response(
                    {
                        "error": "unauthorized",
                        "message": "send Authorization: Bearer <token>; the token is in the "
                        "agent's state directory (file 'token')",
                    },
                    status=401,
                )
            log.info("control request: %s", name)
            return web.json_response(await self._actions[name]())

        return handler
