"""RunPod: terminate or stop this pod through the REST API v2 (shared/contracts/providers.md).

- id: ``teardown.instance_id``, else ``RUNPOD_POD_ID`` (RunPod sets it in every pod);
- key: ``RUNPOD_API_KEY`` (RunPod sets a pod-scoped one in every pod); Bearer;
- terminate ``DELETE /v2/pods/{id}`` (204; a cluster pod answers 409: then
  ``POST /v2/pods/{id}/action {"action": "terminate"}``); stop
  ``POST /v2/pods/{id}/action {"action": "stop"}`` (200 pod JSON or 204; 409 when the pod's state
  does not allow it); read ``GET /v2/pods/{id}``: ``status`` EXITED is stopped, TERMINATED or a
  404 is gone (the contract leaves open which one a terminated pod gives: both are accepted);
  the price is the v2 Pod's ``cost`` (``costPerHr``/``adjustedCostPerHr`` where a v1-shaped
  answer carries them instead; none of them: the price is unknown, never an error).
- Errors are application/problem+json ``{title, status, detail}``; 429 carries Retry-After.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.config.model import TeardownAction
from agent.providers import ProviderError
from agent.providers.api import ApiProvider, Client, Reading, Sent, gone_404, number

#: Where a pod says its price (USD per hour), first found wins: the REST v2 Pod's ``cost``
#: ("0.0 when EXITED or TERMINATED"), then REST v1/GraphQL's ``adjustedCostPerHr`` (after
#: discounts) and ``costPerHr``. A pod with none of them has no known price.
PRICE_FIELDS = ("cost", "adjustedCostPerHr", "costPerHr")


def pod_price(pod: Mapping[str, object]) -> float | None:
    """The pod's price from whichever field the answer carries, or None."""
    for name in PRICE_FIELDS:
        price = number(pod.get(name))
        if price is not None:
            return price
    return None


class RunPodProvider(ApiProvider):
    name = "runpod"
    can_stop = True
    default_url = "https://api.runpod.io"
    console = "https://console.runpod.io/pods"

    def _key(self) -> tuple[str, str]:
        if self.env.runpod_api_key:
            return "RUNPOD_API_KEY", self.env.runpod_api_key
        raise ProviderError(
            "config",
            "runpod: no API key: set RUNPOD_API_KEY (RunPod sets a pod-scoped key in every pod; "
            "or an account key with write access to pods)",
        )

    def _key_fix(self, variable: str) -> str:
        return (
            f"set {variable} to a key that can manage this pod (the pod's own key, or an "
            "account key with write access), and check RUNPOD_POD_ID/teardown.instance_id"
        )

    async def _locate(self, api: Client) -> tuple[str, str, Reading | None]:
        iid, source = self.configured_id(
            "RUNPOD_POD_ID", self.env.runpod_pod_id, "RunPod sets it in every pod"
        )
        return iid, source, None

    def _path(self, instance_id: str) -> str:
        return f"/v2/pods/{self.id_in_path(instance_id)}"

    async def _read(self, api: Client, instance_id: str, deadline: float | None) -> Reading:
        what = f"runpod: read pod {instance_id}"
        reply = await api.request("GET", self._path(instance_id), what, deadline=deadline)
        if gone_404(reply):
            return Reading("gone", f"not found ({api.describe(reply)})")
        data = reply.data
        if reply.status != 200 or not isinstance(data, Mapping) or "status" not in data:
            raise ProviderError("rejected", f"{what}: unexpected answer {api.describe(reply)}")
        status = data.get("status")
        text = api.clean(f"status={status}")
        price = pod_price(data)
        if status == "TERMINATED":
            return Reading("gone", text, price)
        if status == "EXITED":
            return Reading("stopped", text, price)
        return Reading("up", text, price)

    async def _send(self, api: Client, action: TeardownAction, instance_id: str) -> Sent:
        path = self._path(instance_id)
        if action == "destroy":
            what = f"runpod: terminate pod {instance_id}"
            reply = await api.request("DELETE", path, what)
            if reply.status == 409:
                # A cluster pod cannot be deleted directly: the terminate action can.
                first, unsure = api.describe(reply), reply.uncertain
                reply = await api.request(
                    "POST", path + "/action", what, body={"action": "terminate"}
                )
                if not 200 <= reply.status < 300 and not gone_404(reply):
                    return Sent(
                        "refused",
                        f"DELETE {first}; action terminate {api.describe(reply)}",
                        unsure or reply.uncertain,
                    )
        else:
            what = f"runpod: stop pod {instance_id}"
            reply = await api.request("POST", path + "/action", what, body={"action": "stop"})
        if gone_404(reply):
            return Sent("gone", f"{api.describe(reply)}: the pod no longer exists")
        if 200 <= reply.status < 300:
            return Sent("accepted", f"answered HTTP {reply.status}")
        return Sent("refused", api.describe(reply), reply.uncertain)
