"""Vast.ai: destroy or stop this instance through ``/api/v0`` (shared/contracts/providers.md).

- id: ``teardown.instance_id``, else ``CONTAINER_ID`` (Vast sets it in every instance);
- key: ``CONTAINER_API_KEY`` (the per-instance key Vast puts in every instance: it can start,
  stop and destroy that instance only), else ``VAST_API_KEY`` (an account key); Bearer;
- destroy ``DELETE /api/v0/instances/{id}/`` with body ``{}``; stop ``PUT`` the same path with
  ``{"state": "stopped"}``; read ``GET /api/v0/instances/{id}/?owner=me`` ->
  ``{"instances": {...}}``, ``{"instances": null}`` once the instance is gone.

Over SSH the instance's variables may be missing (Vast's docs suggest ``env >>
/etc/environment``); the agent runs under systemd or the container's own environment.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.config.model import TeardownAction
from agent.providers import ProviderError
from agent.providers.api import ApiProvider, Client, Reading, Sent, gone_404, number

#: ``actual_status`` values of a stopped instance: vastai 1.9.1 accepts either.
_STOPPED = ("exited", "stopped")


class VastProvider(ApiProvider):
    name = "vast"
    can_stop = True
    default_url = "https://console.vast.ai"
    console = "https://cloud.vast.ai/instances/"

    def _key(self) -> tuple[str, str]:
        if self.env.container_api_key:
            return "CONTAINER_API_KEY", self.env.container_api_key
        if self.env.vast_api_key:
            return "VAST_API_KEY", self.env.vast_api_key
        raise ProviderError(
            "config",
            "vast: no API key: set CONTAINER_API_KEY (Vast puts this instance's own key in its "
            "environment; over SSH it may be missing: `env >> /etc/environment`) or "
            "VAST_API_KEY (an account key)",
        )

    def _key_fix(self, variable: str) -> str:
        if variable == "CONTAINER_API_KEY":
            return (
                "CONTAINER_API_KEY only acts on the instance it was made for: check CONTAINER_ID "
                "(or teardown.instance_id) names this instance, or unset CONTAINER_API_KEY and "
                "set VAST_API_KEY to a key of the account that owns it"
            )
        return "set VAST_API_KEY to a key of the account that owns this instance"

    async def _locate(self, api: Client) -> tuple[str, str, Reading | None]:
        iid, source = self.configured_id(
            "CONTAINER_ID",
            self.env.container_id,
            "Vast sets it in every instance (over SSH it may be missing: `env >> "
            "/etc/environment`)",
        )
        return iid, source, None

    def _path(self, instance_id: str) -> str:
        return f"/api/v0/instances/{self.id_in_path(instance_id)}/"

    async def _read(self, api: Client, instance_id: str, deadline: float | None) -> Reading:
        what = f"vast: read instance {instance_id}"
        reply = await api.request(
            "GET", self._path(instance_id) + "?owner=me", what, deadline=deadline
        )
        if gone_404(reply):
            return Reading("gone", f"not found ({api.describe(reply)})")
        data = reply.data
        if reply.status != 200 or not isinstance(data, Mapping) or "instances" not in data:
            raise ProviderError("rejected", f"{what}: unexpected answer {api.describe(reply)}")
        row = data["instances"]
        if row is None:
            return Reading("gone", "instances: null (no longer exists)")
        if not isinstance(row, Mapping):
            raise ProviderError("rejected", f"{what}: 'instances' is not an object")
        actual, intended, cur = (
            row.get("actual_status"),
            row.get("intended_status"),
            row.get("cur_state"),
        )
        status = api.clean(f"actual_status={actual} intended_status={intended} cur_state={cur}")
        # dph_total: the instance's whole price per hour (vast-cli's "$/hr" column);
        # disk_space: its allocated disk (GB); storage_cost: USD per GB-month, what a stopped
        # instance keeps paying.
        figures = {
            "price_usd_per_hour": number(row.get("dph_total")),
            "disk_gb": number(row.get("disk_space")),
            "storage_usd_per_gb_month": number(row.get("storage_cost")),
        }
        if actual in _STOPPED:
            return Reading("stopped", status, **figures)
        if cur == "unloaded":  # the contract: "unloaded = released on destroy"
            return Reading("gone", status, **figures)
        # intended_status is only what was asked: it counts when cur_state agrees, and never
        # while the container still reads running.
        if actual != "running" and intended == "stopped" and cur == "stopped":
            return Reading("stopped", status, **figures)
        return Reading("up", status, **figures)

    async def _send(self, api: Client, action: TeardownAction, instance_id: str) -> Sent:
        if action == "destroy":
            method, body = "DELETE", {}
        else:
            method, body = "PUT", {"state": "stopped"}
        what = f"vast: {action} instance {instance_id}"
        reply = await api.request(method, self._path(instance_id), what, body=body)
        data = reply.data
        if gone_404(reply):
            return Sent("gone", f"{api.describe(reply)}: the instance no longer exists")
        if 200 <= reply.status < 300:
            if isinstance(data, Mapping) and data.get("success") is False:
                return Sent("refused", api.describe(reply), reply.uncertain)
            return Sent("accepted", f"{method} answered {api.describe(reply)}")
        return Sent("refused", api.describe(reply), reply.uncertain)
