"""Fake provider APIs (Vast.ai, RunPod REST v2, Lambda Cloud) on 127.0.0.1, one aiohttp server
each, speaking the HTTP contracts in ``shared/contracts/providers.md``: the real paths, auth and
error bodies. Each runs in a background thread with its own event loop, so sync tests, async
tests and other processes (the guard) can all talk to it::

    from tests.fakes.providers import run_fake_vast

    with run_fake_vast(keys={"vast-key"}) as vast:
        vast.add_instance("1234")                 # running
        vast.fail("show", 429, times=2)           # fault knobs, see below
        ... point teardown.api_url at vast.url ...
        assert vast.mutations() == [("DELETE", "/api/v0/instances/1234/", {})]

What every fake does
    - ``url``: ``http://127.0.0.1:PORT``, the base URL (what ``teardown.api_url`` takes);
    - ``keys``: the valid API keys (``Authorization: Bearer KEY``; Lambda also takes Basic).
      Any other key (or none) -> 401 with the provider's error body;
    - ``requests``: every request, as :class:`Call` (method, path, query, body, auth, route,
      status, arrival time);
      ``mutations()`` the mutating ones (DELETE/PUT/POST) as ``(method, path, body)``;
      ``clear_requests()``;
    - ``add_instance(id, ...)``, ``instance(id)`` (a copy of its state, None once gone).

Fault knobs (thread-safe; ``times=None`` means until ``clear_faults()``; ``route`` is a route name
of that fake, see each class, or ``"*"``); each returns the :class:`Fault`, whose ``hits`` counts:
    ``fail(route, status, times=1, retry_after=None, body=None)``  answer an error instead (429 with
        or without ``Retry-After``, 5xx bursts, 401); the body is the provider's own error body
        unless given (``body`` may be ``str``: plain text, as Vast's 429 often is);
    ``hang(route, seconds, times=1, after=False)``  hold the request ``seconds`` before handling
        it (longer than the client's timeout: a timeout); ``after=True`` handles it first (the
        mutation IS applied) and then holds the answer;
    ``down(status=503)`` / ``up()``  the whole API down (every route answers ``status``) for a
        window the test controls, then healthy again;
    ``linger(reads)``  "accepted but still running": after a mutating call is accepted, the next
        ``reads`` reads of that instance still show it as before (``None``: forever).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from agent.providers.api import Timing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Call:
    """One request the fake received."""

    method: str
    path: str
    query: dict[str, str]
    #: The body parsed as JSON; the raw text when it is not JSON; None when empty.
    body: Any
    #: The key from ``Authorization`` (Bearer or Basic), or None.
    auth: str | None
    route: str
    status: int = 0
    #: ``time.monotonic()`` when it arrived.
    at: float = field(default_factory=time.monotonic)


@dataclass
class Fault:
    route: str
    times: int | None
    status: int | None = None
    retry_after: str | None = None
    body: Any = None
    delay_s: float = 0.0
    #: Delay after handling (the request took effect, the answer is late).
    after_s: float = 0.0
    hits: int = 0

    def take(self) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        self.hits += 1
        return True


@dataclass
class Pending:
    """A mutation accepted but not yet visible: ``reads`` more reads show the old state."""

    action: str
    reads: int | None


class FakeProvider:
    """Shared machinery: auth, request log, faults, lingering mutations. Subclasses add routes."""

    #: Name used in thread names and messages.
    kind = "provider"

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = set(keys)
        self.url = ""
        self.requests: list[Call] = []
        self._faults: list[Fault] = []
        self._linger: int | None = 0
        self._pending: dict[str, Pending] = {}
        self._instances: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ test-side helpers

    def fail(
        self,
        route: str,
        status: int,
        *,
        times: int | None = 1,
        retry_after: str | float | None = None,
        body: Any = None,
    ) -> Fault:
        fault = Fault(
            route,
            times,
            status=status,
            retry_after=None if retry_after is None else str(retry_after),
            body=body,
        )
        with self.lock:
            self._faults.append(fault)
        return fault

    def hang(
        self, route: str, seconds: float, *, times: int | None = 1, after: bool = False
    ) -> Fault:
        fault = Fault(
            route, times, delay_s=0.0 if after else seconds, after_s=seconds if after else 0.0
        )
        with self.lock:
            self._faults.append(fault)
        return fault

    def linger(self, reads: int | None) -> None:
        with self.lock:
            self._linger = reads

    def clear_faults(self) -> None:
        with self.lock:
            self._faults.clear()

    def down(self, status: int = 503, *, retry_after: str | float | None = None) -> Fault:
        """The whole API down: every request answers ``status`` (the provider's own error body)
        until :meth:`up`; the fault's ``hits`` counts the requests turned away."""
        return self.fail("*", status, times=None, retry_after=retry_after)

    def up(self) -> None:
        """The API healthy again (every fault cleared)."""
        self.clear_faults()

    def clear_requests(self) -> None:
        with self.lock:
            self.requests.clear()

    def mutations(self) -> list[tuple[str, str, Any]]:
        with self.lock:
            return [
                (c.method, c.path, c.body)
                for c in self.requests
                if c.method in ("DELETE", "PUT", "POST", "PATCH")
            ]

    def calls(self, route: str) -> list[Call]:
        with self.lock:
            return [c for c in self.requests if c.route == route]

    def instance(self, instance_id: str) -> dict[str, Any] | None:
        with self.lock:
            inst = self._instances.get(instance_id)
            return dict(inst) if inst is not None else None

    # ------------------------------------------------------------------ subclass hooks

    def routes(self) -> list[tuple[str, str, str, Handler]]:
        """``(method, path, route name, handler)``."""
        raise NotImplementedError

    def unauthorized(self) -> web.Response:
        raise NotImplementedError

    def error(self, status: int, body: Any = None) -> web.Response:
        """The provider's error answer for ``status`` (used by ``fail``)."""
        raise NotImplementedError

    def authorized(self, request: web.Request, key: str | None) -> bool:
        return key is not None and key in self.keys

    def apply(self, instance_id: str, action: str) -> None:
        """Make ``action`` visible on the instance (called with the lock held)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lingering mutations

    def accept(self, instance_id: str, action: str) -> None:
        """A mutating call was accepted: apply it now or after the lingering reads."""
        with self.lock:
            if self._linger == 0:
                self.apply(instance_id, action)
            else:
                self._pending[instance_id] = Pending(action, self._linger)

    def before_read(self, instance_id: str) -> None:
        """Count one read of the instance; apply a pending mutation once its reads ran out."""
        with self.lock:
            pending = self._pending.get(instance_id)
            if pending is None:
                return
            if pending.reads is not None and pending.reads <= 0:
                del self._pending[instance_id]
                self.apply(instance_id, pending.action)
            elif pending.reads is not None:
                pending.reads -= 1

    # ------------------------------------------------------------------ the server

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        for method, path, name, handler in self.routes():
            app.router.add_route(method, path, handler, name=name)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        raw = await request.text()
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw
        route = request.match_info.route.name or "?"
        call = Call(
            request.method,
            request.path,
            dict(request.query),
            body,
            _key(request.headers.get("Authorization")),
            route,
        )
        with self.lock:
            self.requests.append(call)
            faults = [f for f in self._faults if f.route in (route, "*") and f.take()]
        response: web.StreamResponse | None = None
        for fault in faults:
            if fault.delay_s:
                await asyncio.sleep(fault.delay_s)
            if fault.status is not None and response is None:
                response = self.error(fault.status, fault.body)
                if fault.retry_after is not None:
                    response.headers["Retry-After"] = fault.retry_after
        if response is None:
            if not self.authorized(request, call.auth):
                response = self.unauthorized()
            else:
                response = await handler(request)
        call.status = response.status
        for fault in faults:
            if fault.after_s:
                await asyncio.sleep(fault.after_s)
        return response


def _key(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        # Lambda: base64("KEY:") or the bare key.
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return value.strip() or None
        return decoded.partition(":")[0] or None
    return None


def _json(data: Any, status: int = 200, content_type: str = "application/json") -> web.Response:
    return web.Response(status=status, text=json.dumps(data), content_type=content_type)


# --------------------------------------------------------------------------------------------
# Vast.ai


class FakeVast(FakeProvider):
    """``/api/v0``: show ``GET /instances/{id}/?owner=me`` (route ``show``), destroy
    ``DELETE /instances/{id}/`` (``destroy``), stop/start ``PUT /instances/{id}/ {"state"}``
    (``stop``), ``GET /users/current`` (``user``).

    ``instance_keys``: per-instance keys (``CONTAINER_API_KEY``) -> the one instance id each may
    act on (another id -> 401). ``stopped_status``: what ``actual_status`` a stopped instance
    reads (``exited`` or ``stopped``: both happen). A destroyed instance reads
    ``{"instances": null}``; a DELETE of an unknown id is 404 ``no_such_instance``."""

    kind = "vast"

    def __init__(
        self,
        keys: Iterable[str],
        instance_keys: dict[str, str] | None = None,
        stopped_status: str = "exited",
    ) -> None:
        super().__init__(keys)
        self.instance_keys = dict(instance_keys or {})
        self.stopped_status = stopped_status

    def add_instance(
        self,
        instance_id: str,
        *,
        status: str = "running",
        dph_total: float | None = 3.4828,
        disk_space: float | None = 250.0,
        storage_cost: float | None = 0.20,
    ) -> None:
        """An instance row as ``show instance`` reads it: ``dph_total`` (USD per hour, all in),
        ``disk_space`` (the allocated disk, GB) and ``storage_cost`` (USD per GB-month: what a
        stopped instance still pays); None leaves a field out."""
        optional = {"dph_total": dph_total, "disk_space": disk_space, "storage_cost": storage_cost}
        with self.lock:
            self._instances[instance_id] = {
                "id": int(instance_id) if instance_id.isdigit() else instance_id,
                "actual_status": status,
                "intended_status": "running" if status == "running" else "stopped",
                "cur_state": "running" if status == "running" else "stopped",
                "next_state": "running" if status == "running" else "stopped",
                "is_bid": False,
                "status_msg": "success, running",
                "start_date": time.time() - 3600,
                "extra_env": [["CONTAINER_ID", instance_id]],
                "label": None,
                **{k: v for k, v in optional.items() if v is not None},
            }

    def routes(self) -> list[tuple[str, str, str, Handler]]:
        return [
            ("GET", "/api/v0/instances/{id}/", "show", self._show),
            ("DELETE", "/api/v0/instances/{id}/", "destroy", self._destroy),
            ("PUT", "/api/v0/instances/{id}/", "stop", self._put),
            ("GET", "/api/v0/users/current", "user", self._user),
        ]

    def authorized(self, request: web.Request, key: str | None) -> bool:
        if key in self.keys:
            return True
        if key in self.instance_keys:
            target = request.match_info.get("id")
            return target is None or target == self.instance_keys[key]
        return False

    def unauthorized(self) -> web.Response:
        return self.error(401)

    def error(self, status: int, body: Any = None) -> web.Response:
        if isinstance(body, str):
            return web.Response(status=status, text=body, content_type="text/plain")
        if body is not None:
            return _json(body, status)
        if status == 429:  # Vast's usual 429: plain text, no Retry-After
            return web.Response(status=429, text="API requests too frequent")
        error, msg = {
            400: ("invalid_args", "Invalid arguments."),
            401: ("invalid_user_key", "Invalid user key"),
            404: ("no_such_instance", "Instance not found."),
        }.get(status, ("server_error", "Internal server error"))
        return _json({"success": False, "error": error, "msg": msg}, status)

    def apply(self, instance_id: str, action: str) -> None:
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        if action == "destroy":
            del self._instances[instance_id]
        elif action == "stop":
            inst.update(
                actual_status=self.stopped_status,
                intended_status="stopped",
                cur_state="stopped",
                next_state="stopped",
            )
        elif action == "start":
            inst.update(
                actual_status="running",
                intended_status="running",
                cur_state="running",
                next_state="running",
            )

    async def _show(self, request: web.Request) -> web.Response:
        iid = request.match_info["id"]
        self.before_read(iid)
        with self.lock:
            inst = self._instances.get(iid)
            pending = self._pending.get(iid)
            row = dict(inst) if inst is not None else None
        if row is not None and pending is not None:
            # Real Vast: intended_status moves at once, the container follows later.
            row["intended_status"] = "stopped"
        return _json({"instances": row})

    async def _destroy(self, request: web.Request) -> web.Response:
        iid = request.match_info["id"]
        if self.instance(iid) is None:
            return self.error(404)
        self.accept(iid, "destroy")
        return _json({"success": True, "msg": f"destroying instance {iid}."})

    async def _put(self, request: web.Request) -> web.Response:
        iid = request.match_info["id"]
        try:
            body = await request.json()
        except ValueError:
            return self.error(400)
        state = body.get("state") if isinstance(body, dict) else None
        if state not in ("stopped", "running"):
            return self.error(400)
        if self.instance(iid) is None:
            return self.error(404)
        self.accept(iid, "stop" if state == "stopped" else "start")
        return _json({"success": True, "msg": f"instance {iid} state change to {state}."})

    async def _user(self, request: web.Request) -> web.Response:
        return _json({"id": 1, "username": "fake", "balance": 10.0})


# --------------------------------------------------------------------------------------------
# RunPod REST v2


class FakeRunPod(FakeProvider):
    """``/v2``: ``GET /pods/{id}`` (route ``get``), ``DELETE /pods/{id}`` (``delete``, 204),
    ``POST /pods/{id}/action {"action"}`` (``action``). Errors are application/problem+json
    ``{title, status, detail}``; 429 carries ``Retry-After`` and RateLimit headers unless the
    fault says otherwise. Actions follow the pod's ``actions`` (the v2 OpenAPI): RUNNING
    stop|restart|terminate; EXITED, ERROR start|terminate; PROVISIONING, STARTING stop|terminate;
    anything else -> 409. An action outside the enum -> 400, extra body keys -> 422.

    ``terminated``: what a terminated pod reads, ``"404"`` or ``"TERMINATED"`` (the contract
    leaves it open). ``cluster``: ids whose DELETE is 409 (the action terminate works)."""

    kind = "runpod"
    ACTIONS = {
        "RUNNING": ["stop", "restart", "terminate"],
        "EXITED": ["start", "terminate"],
        "ERROR": ["start", "terminate"],
        "PROVISIONING": ["stop", "terminate"],
        "STARTING": ["stop", "terminate"],
        "TERMINATED": [],
    }

    #: The price fields a pod may carry: ``cost`` (REST v2: "Current cost in USD per hour (0.0
    #: when EXITED or TERMINATED)"), ``costPerHr`` / ``adjustedCostPerHr`` (REST v1, GraphQL).
    PRICE_FIELDS = ("cost", "costPerHr", "adjustedCostPerHr")

    def __init__(
        self, keys: Iterable[str], terminated: str = "404", cluster: Iterable[str] = ()
    ) -> None:
        super().__init__(keys)
        self.terminated = terminated
        self.cluster = set(cluster)

    def add_instance(
        self,
        instance_id: str,
        *,
        status: str = "RUNNING",
        cost: float = 0.69,
        price_fields: Iterable[str] = ("cost",),
    ) -> None:
        """A pod; its price ``cost`` goes into each of ``price_fields`` (default the v2 Pod's
        ``cost`` alone; ``()``: a pod without a price)."""
        fields = tuple(price_fields)
        unknown = set(fields) - set(self.PRICE_FIELDS)
        if unknown:
            raise ValueError(f"not a RunPod price field: {sorted(unknown)}")
        with self.lock:
            self._instances[instance_id] = {
                "id": instance_id,
                "name": f"pod-{instance_id}",
                "status": status,
                "gpuCount": 1,
                "image": "runpod/pytorch:2.4.0",
                "_price": cost,
                "_price_fields": fields,
            }

    def routes(self) -> list[tuple[str, str, str, Handler]]:
        return [
            ("GET", "/v2/pods/{id}", "get", self._get),
            ("DELETE", "/v2/pods/{id}", "delete", self._delete),
            ("POST", "/v2/pods/{id}/action", "action", self._action),
        ]

    def unauthorized(self) -> web.Response:
        return self.error(401)

    def error(self, status: int, body: Any = None, detail: str | None = None) -> web.Response:
        if isinstance(body, str):
            return web.Response(status=status, text=body, content_type="text/plain")
        titles = {
            400: "Bad Request",
            401: "Unauthorized",
            403: "Forbidden",
            404: "Not Found",
            409: "Conflict",
            422: "Unprocessable Entity",
            429: "Too Many Requests",
        }
        problem = body or {
            "title": titles.get(status, "Internal Server Error"),
            "status": status,
            "detail": detail or titles.get(status, "Internal Server Error"),
        }
        response = _json(problem, status, content_type="application/problem+json")
        if status == 429:
            response.headers["RateLimit"] = '"default";r=0;t=1'
            response.headers["RateLimit-Policy"] = '"default";q=10;w=1'
        return response

    def _pod(self, iid: str) -> dict[str, Any] | None:
        inst = self._instances.get(iid)
        if inst is None:
            return None
        pod = {k: v for k, v in inst.items() if not k.startswith("_")}
        pod["actions"] = list(self.ACTIONS.get(pod["status"], []))
        billed = pod["status"] not in ("EXITED", "TERMINATED")
        for name in inst["_price_fields"]:
            # v2: "0.0 when EXITED or TERMINATED"; the v1 fields keep the pod's rate.
            pod[name] = inst["_price"] if billed or name != "cost" else 0.0
        return pod

    def apply(self, instance_id: str, action: str) -> None:
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        if action == "terminate":
            if self.terminated == "404":
                del self._instances[instance_id]
            else:
                inst["status"] = "TERMINATED"
        elif action == "stop":
            inst["status"] = "EXITED"
        elif action in ("start", "restart"):
            inst["status"] = "RUNNING"

    async def _get(self, request: web.Request) -> web.Response:
        iid = request.match_info["id"]
        self.before_read(iid)
        with self.lock:
            pod = self._pod(iid)
        if pod is None:
            return self.error(404, detail=f"pod {iid} not found")
        return _json(pod)

    async def _delete(self, request: web.Request) -> web.StreamResponse:
        iid = request.match_info["id"]
        with self.lock:
            pod = self._pod(iid)
        if pod is None:
            return self.error(404, detail=f"pod {iid} not found")
        if iid in self.cluster:
            return self.error(409, detail="a cluster pod cannot be deleted; use the action")
        self.accept(iid, "terminate")
        return web.Response(status=204)

    async def _action(self, request: web.Request) -> web.Response:
        iid = request.match_info["id"]
        try:
            body = await request.json()
        except ValueError:
            return self.error(400, detail="body is not JSON")
        if not isinstance(body, dict) or body.get("action") not in (
            "stop",
            "start",
            "restart",
            "terminate",
        ):
            return self.error(400, detail="action must be one of stop, start, restart, terminate")
        if set(body) != {"action"}:
            return self.error(422, detail="unexpected body keys")
        with self.lock:
            pod = self._pod(iid)
        if pod is None:
            return self.error(404, detail=f"pod {iid} not found")
        if body["action"] not in pod["actions"]:
            return self.error(
                409, detail=f"action {body['action']} is not allowed in status {pod['status']}"
            )
        self.accept(iid, body["action"])
        with self.lock:
            now = self._pod(iid)
        return _json(now or pod)


# --------------------------------------------------------------------------------------------
# Lambda Cloud


class FakeLambda(FakeProvider):
    """``/api/v1``: ``GET /instances`` (route ``list``), ``GET /instances/{id}`` (``get``),
    ``POST /instance-operations/terminate {"instance_ids": [...]}`` (``terminate``). Bearer or
    Basic auth. Errors ``{"error": {code, message, suggestion}}``. A terminated instance reads
    ``terminating`` while the mutation lingers, then ``terminated`` (``terminated="status"``) or
    404 ``global/object-does-not-exist`` (``terminated="404"``)."""

    kind = "lambda"

    def __init__(self, keys: Iterable[str], terminated: str = "status") -> None:
        super().__init__(keys)
        self.terminated = terminated

    def add_instance(
        self,
        instance_id: str,
        *,
        ip: str | None = None,
        private_ip: str | None = None,
        hostname: str | None = None,
        status: str = "active",
        price_cents_per_hour: int = 129,
    ) -> None:
        with self.lock:
            self._instances[instance_id] = {
                "id": instance_id,
                "name": f"inst-{instance_id[:6]}",
                "ip": ip,
                "private_ip": private_ip,
                "hostname": hostname,
                "status": status,
                "ssh_key_names": ["key"],
                "file_system_names": [],
                "region": {"name": "us-west-1", "description": "California, USA"},
                "instance_type": {
                    "name": "gpu_1x_a10",
                    "description": "1x A10 (24 GB PCIe)",
                    "gpu_description": "A10 (24 GB PCIe)",
                    "price_cents_per_hour": price_cents_per_hour,
                    "specs": {"vcpus": 30, "memory_gib": 200, "storage_gib": 1400, "gpus": 1},
                },
                "actions": {"terminate": {"available": True}},
            }

    def routes(self) -> list[tuple[str, str, str, Handler]]:
        return [
            ("GET", "/api/v1/instances", "list", self._list),
            ("GET", "/api/v1/instances/{id}", "get", self._get),
            ("POST", "/api/v1/instance-operations/terminate", "terminate", self._terminate),
        ]

    def unauthorized(self) -> web.Response:
        return self.error(401)

    def error(self, status: int, body: Any = None) -> web.Response:
        if isinstance(body, str):
            return web.Response(status=status, text=body, content_type="text/plain")
        if body is not None:
            return _json(body, status)
        code, message, suggestion = {
            400: ("global/invalid-parameters", "Invalid request parameters.", None),
            401: (
                "global/invalid-api-key",
                "API key was invalid, expired, or deleted.",
                "Check your API key or create a new one, then try again.",
            ),
            403: ("global/account-inactive", "Your account is inactive.", None),
            404: ("global/object-does-not-exist", "Specified instance does not exist.", None),
            429: ("global/rate-limited", "Too many requests.", None),
        }.get(status, ("global/unknown", "An unknown error occurred.", None))
        err: dict[str, str] = {"code": code, "message": message}
        if suggestion:
            err["suggestion"] = suggestion
        return _json({"error": err}, status)

    def apply(self, instance_id: str, action: str) -> None:
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        if self.terminated == "404":
            del self._instances[instance_id]
        else:
            inst["status"] = "terminated"

    async def _list(self, request: web.Request) -> web.Response:
        with self.lock:
            data = [dict(i) for i in self._instances.values()]
        return _json({"data": data})

    async def _get(self, request: web.Request) -> web.Response:
        iid = request.match_info["id"]
        self.before_read(iid)
        with self.lock:
            inst = self._instances.get(iid)
            row = dict(inst) if inst is not None else None
        if row is None:
            return self.error(404)
        return _json({"data": row})

    async def _terminate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return self.error(400)
        ids = body.get("instance_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            return self.error(400)
        if any(self.instance(i) is None for i in ids):
            return self.error(404)
        # UNCONFIRMED how Lambda answers a second terminate: the fake refuses it, as the
        # instance's actions no longer offer terminate.
        if any(self.instance(i)["status"] in ("terminating", "terminated") for i in ids):  # type: ignore[index]
            return self.error(400)
        out = []
        for iid in ids:
            with self.lock:
                self._instances[iid]["status"] = "terminating"
                out.append(dict(self._instances[iid]))
            self.accept(iid, "terminate")
        return _json({"data": {"terminated_instances": out}})


# --------------------------------------------------------------------------------------------
# Running a fake


def fast_timing(**overrides: float) -> Timing:
    """Provider timing for tests: sub-second timeouts, backoff and read-back."""
    values: dict[str, float] = {
        "connect_timeout_s": 2.0,
        "request_timeout_s": 0.5,
        "retry_s": 10.0,
        "backoff_first_s": 0.01,
        "backoff_max_s": 0.05,
        "retry_after_max_s": 0.05,
        "confirm_s": 10.0,
        "poll_first_s": 0.01,
        "poll_max_s": 0.05,
    }
    values.update(overrides)
    return Timing(**values)


class _ServerThread:
    def __init__(self, fake: FakeProvider) -> None:
        self.fake = fake
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=f"fake-{fake.kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"the fake {self.fake.kind} did not start") from self._error
        if not self._ready.is_set():
            raise RuntimeError(f"the fake {self.fake.kind} did not start within 30 s")

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        runner: web.AppRunner | None = None
        try:
            runner = web.AppRunner(self.fake.make_app(), access_log=None, shutdown_timeout=1.0)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            if runner is not None:
                loop.run_until_complete(runner.cleanup())
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            for task in asyncio.all_tasks(loop):
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(30)


F = TypeVar("F", bound=FakeProvider)


@contextlib.contextmanager
def serve(fake: F) -> Iterator[F]:
    """Serve ``fake`` on 127.0.0.1 (a free port) for the ``with`` block."""
    server = _ServerThread(fake)
    server.start()
    try:
        yield fake
    finally:
        server.stop()


def run_fake_vast(
    keys: Iterable[str] = ("vast-account-key-0123456789",),
    *,
    instance_keys: dict[str, str] | None = None,
    stopped_status: str = "exited",
) -> contextlib.AbstractContextManager[FakeVast]:
    return serve(FakeVast(keys, instance_keys, stopped_status))


def run_fake_runpod(
    keys: Iterable[str] = ("runpod-key-0123456789",),
    *,
    terminated: str = "404",
    cluster: Iterable[str] = (),
) -> contextlib.AbstractContextManager[FakeRunPod]:
    return serve(FakeRunPod(keys, terminated, cluster))


def run_fake_lambda(
    keys: Iterable[str] = ("lambda-key-0123456789",), *, terminated: str = "status"
) -> contextlib.AbstractContextManager[FakeLambda]:
    return serve(FakeLambda(keys, terminated))
