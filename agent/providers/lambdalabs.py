"""Lambda Cloud: terminate this instance through ``/api/v1`` (shared/contracts/providers.md).

- key: ``LAMBDA_API_KEY`` (an account key: Lambda puts none on the instance); Bearer;
- id: ``teardown.instance_id``, else found by ``GET /api/v1/instances``: the one instance whose
  ``ip``, ``private_ip`` or ``hostname`` is this machine's (its interface addresses, its host
  name, and the address a dashed host name such as ``104-171-203-50`` spells). Two matches are
  refused, never guessed: the API key can terminate every instance of the account;
- terminate ``POST /api/v1/instance-operations/terminate {"instance_ids": [id]}`` naming only the
  id found; read ``GET /api/v1/instances/{id}``: status ``terminated`` or a 404 is gone
  (``terminating`` is read again);
- no stop: a ``stop`` policy is refused by ``check``; asked anyway, nothing is sent.

Base ``https://cloud.lambda.ai`` (``cloud.lambdalabs.com`` is the deprecated secondary).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import psutil

from agent.config.jobvalues import instance_id_problem
from agent.config.model import Env, TeardownAction, TeardownSection
from agent.providers import ProviderError
from agent.providers.api import ApiProvider, Client, Reading, Sent, Timing, gone_404, number


def local_names() -> frozenset[str]:
    """This machine's addresses (every interface, loopback and link-local left out) and host
    names, lowercased; a dashed host name (``104-171-203-50``) also gives its address."""
    names: set[str] = set()
    for host in (socket.gethostname(), socket.getfqdn()):
        host = host.lower().rstrip(".")
        if host and host != "localhost":
            names.add(host)
            dotted = host.split(".")[0].replace("-", ".")
            if _usable_ip(dotted):
                names.add(dotted)
    try:
        interfaces = psutil.net_if_addrs()
    except OSError:
        interfaces = {}
    for addrs in interfaces.values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                address = a.address.split("%")[0].lower()
                if _usable_ip(address):
                    names.add(address)
    return frozenset(names)


def _usable_ip(text: str) -> bool:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def matching(instances: Iterable[object], names: Iterable[str]) -> list[Mapping[str, Any]]:
    """The instances whose ``ip``, ``private_ip`` or ``hostname`` is one of ``names``."""
    wanted = {n.lower().rstrip(".") for n in names if n}
    found = []
    for inst in instances:
        if not isinstance(inst, Mapping):
            continue
        own = {
            v.lower().rstrip(".")
            for v in (inst.get("ip"), inst.get("private_ip"), inst.get("hostname"))
            if isinstance(v, str) and v
        }
        if own & wanted:
            found.append(inst)
    return found


class LambdaProvider(ApiProvider):
    name = "lambda"
    can_stop = False
    default_url = "https://cloud.lambda.ai"
    console = "https://cloud.lambda.ai/instances"

    def __init__(
        self,
        cfg: TeardownSection,
        env: Env,
        *,
        timing: Timing | None = None,
        names: Callable[[], Iterable[str]] = local_names,
    ) -> None:
        super().__init__(cfg, env, timing=timing)
        self._names = names

    def _no_stop(self) -> str:
        return "lambda: Lambda has no stop (use destroy or keep)"

    def _key(self) -> tuple[str, str]:
        if self.env.lambda_api_key:
            return "LAMBDA_API_KEY", self.env.lambda_api_key
        raise ProviderError(
            "config",
            "lambda: no API key: set LAMBDA_API_KEY (an API key of the account that owns this "
            "instance, from the Lambda Cloud dashboard: API keys)",
        )

    def _key_fix(self, variable: str) -> str:
        return f"set {variable} to an active API key of the account that owns this instance"

    async def _locate(self, api: Client) -> tuple[str, str, Reading | None]:
        if self.cfg.instance_id is not None:
            return self.cfg.instance_id, "teardown.instance_id", None
        what = "lambda: list instances"
        reply = await api.request("GET", "/api/v1/instances", what)
        data = reply.data.get("data") if isinstance(reply.data, Mapping) else None
        if reply.status != 200 or not isinstance(data, list):
            raise ProviderError("rejected", f"{what}: unexpected answer {api.describe(reply)}")
        names = sorted(self._names())
        found = matching(data, names)
        live = [i for i in found if i.get("status") != "terminated"]
        pick = live or found
        if len(pick) != 1:
            looked = ", ".join(names) or "none found"
            if pick:
                ids = ", ".join(api.clean(str(i.get("id")), 40) for i in pick)
                problem = f"{len(pick)} instances match this machine ({ids})"
            else:
                problem = f"no instance of the {len(data)} listed matches this machine"
            raise ProviderError(
                "ambiguous",
                f"lambda: {problem} (its addresses and host names: {api.clean(looked, 200)}); "
                "refusing to guess: set teardown.instance_id",
            )
        inst = pick[0]
        iid = inst.get("id")
        if not isinstance(iid, str) or instance_id_problem(iid):
            raise ProviderError("rejected", f"{what}: the matching instance has no usable id")
        matched = next(
            f"{key} {inst[key]}"
            for key in ("ip", "private_ip", "hostname")
            if isinstance(inst.get(key), str)
            and inst[key].lower().rstrip(".") in {n.lower().rstrip(".") for n in names}
        )
        return iid, api.clean(f"matched {matched}", 100), self._reading(api, inst)

    def _reading(self, api: Client, inst: Mapping[str, Any]) -> Reading:
        status = inst.get("status")
        text = api.clean(f"status={status}")
        itype = inst.get("instance_type")
        cents = number(itype.get("price_cents_per_hour")) if isinstance(itype, Mapping) else None
        price = cents / 100 if cents is not None else None
        if status == "terminated":
            return Reading("gone", text, price)
        return Reading("up", text, price)

    async def _read(self, api: Client, instance_id: str, deadline: float | None) -> Reading:
        what = f"lambda: read instance {instance_id}"
        path = f"/api/v1/instances/{self.id_in_path(instance_id)}"
        reply = await api.request("GET", path, what, deadline=deadline)
        if gone_404(reply):
            return Reading("gone", f"not found ({api.describe(reply)})")
        data = reply.data.get("data") if isinstance(reply.data, Mapping) else None
        if reply.status != 200 or not isinstance(data, Mapping):
            raise ProviderError("rejected", f"{what}: unexpected answer {api.describe(reply)}")
        return self._reading(api, data)

    async def _send(self, api: Client, action: TeardownAction, instance_id: str) -> Sent:
        if action != "destroy":
            raise ProviderError("rejected", f"lambda: {self._no_stop()}")
        what = f"lambda: terminate instance {instance_id}"
        # Only ever the one id identified: the key can terminate every instance of the account.
        body = {"instance_ids": [self.id_in_path(instance_id)]}
        reply = await api.request("POST", "/api/v1/instance-operations/terminate", what, body=body)
        if gone_404(reply):
            return Sent("gone", f"{api.describe(reply)}: the instance no longer exists")
        if reply.status != 200:
            return Sent("refused", api.describe(reply), reply.uncertain)
        data = reply.data.get("data") if isinstance(reply.data, Mapping) else None
        listed = data.get("terminated_instances") if isinstance(data, Mapping) else None
        ids = [i.get("id") for i in listed if isinstance(i, Mapping)] if listed else []
        if instance_id in ids:
            return Sent("accepted", "listed in terminated_instances")
        # The contract: terminated_instances "may not contain all"; the read-back decides.
        return Sent("accepted", "answered 200, not listed in terminated_instances")
