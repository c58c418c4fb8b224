"""The Hub side: the dataset's size and access, and whether ``HF_TOKEN`` is valid and can write.

Two calls to the Hugging Face Hub (the dataset file's metadata, ``whoami``), each in a daemon
thread under its own timeout, made while the probe runs; a Hub that cannot be reached is a
warning, never a hang.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from agent.config.model import Env
from agent.preflight.plan import Plan
from agent.preflight.report import FAIL, PASS, WARN, Check, make_check
from agent.util.text import format_bytes
from agent.util.threads import in_thread

#: Seconds each Hub call (dataset metadata, token check) may take.
HUB_TIMEOUT_S = 30.0

#: What the Hub said about the dataset file (``skipped``: the job has no Hub dataset).
DatasetAccess = Literal[
    "skipped",
    "ok",
    "missing_file",
    "missing_revision",
    "no_access",
    "gated",
    "unreachable",
    "error",
]
#: What the Hub said about ``HF_TOKEN`` (``skipped``: not set, or nothing needs it).
TokenAccess = Literal["skipped", "ok", "invalid", "unreachable", "error"]
#: How a failed Hub call is classified (:func:`_classify_hub_error`).
HubErrorKind = Literal["gated", "missing_revision", "no_access", "unreachable", "error"]


@dataclass(frozen=True)
class HubFacts:
    """What the Hub answered about the dataset and the token (the checks are judged from it)."""

    dataset: DatasetAccess = "skipped"
    #: The dataset archive's size in bytes, when the Hub gave it.
    dataset_size: int | None = None
    dataset_error: str | None = None
    token: TokenAccess = "skipped"
    whoami: Mapping[str, Any] | None = None
    token_error: str | None = None


def _classify_hub_error(
    exc: BaseException, timeout_s: float, token: str | None
) -> tuple[HubErrorKind, str]:
    import agent.hub as hub_client

    if isinstance(exc, TimeoutError):
        return "unreachable", f"no answer within {timeout_s:.0f} s"
    # One classifier for the whole agent (agent/hub.py): the same "retryable" everywhere.
    failure = hub_client.classify(exc, token=token)
    if failure.kind in ("gated", "missing_revision"):
        return failure.kind, failure.detail
    if failure.kind in ("missing_repo", "unauthorized", "forbidden"):
        return "no_access", failure.detail
    if failure.retryable or failure.kind == "offline":
        return "unreachable", failure.detail
    return "error", failure.detail


async def hub_facts(plan: Plan, env: Env, timeout_s: float) -> HubFacts:
    """Ask the Hub what the checks need (each call under ``timeout_s``); never raises."""
    token = env.hf_token
    ds = plan.dataset
    needs_token_check = token is not None and (ds is not None or plan.sync_hf_repo is not None)

    def dataset_size() -> int | None:
        import agent.hub as hub_client

        assert ds is not None
        infos = hub_client.api(env).get_paths_info(
            ds.repo, [ds.file], repo_type="dataset", revision=ds.revision
        )
        for info in infos:
            if info.path == ds.file and hasattr(info, "size"):
                return int(info.size)
        return None

    def whoami() -> dict[str, Any]:
        import agent.hub as hub_client

        return hub_client.api(env).whoami()

    async def get_dataset() -> tuple[DatasetAccess, int | None, str | None]:
        if ds is None:
            return "skipped", None, None
        try:
            size = await in_thread(dataset_size, timeout_s, "preflight-hub-dataset")
        except Exception as exc:
            status, text = _classify_hub_error(exc, timeout_s, token)
            return status, None, text
        if size is None:
            return "missing_file", None, f"no file {ds.file!r} in {ds.repo}@{ds.revision}"
        return "ok", size, None

    async def get_whoami() -> tuple[TokenAccess, Mapping[str, Any] | None, str | None]:
        if not needs_token_check:
            return "skipped", None, None
        try:
            who = await in_thread(whoami, timeout_s, "preflight-hub-whoami")
        except Exception as exc:
            kind, text = _classify_hub_error(exc, timeout_s, token)
            # gated and missing_revision do not happen to whoami; they would read as "error".
            status: TokenAccess = (
                "invalid"
                if kind == "no_access"
                else "unreachable"
                if kind == "unreachable"
                else "error"
            )
            return status, None, text
        return "ok", who, None

    (d_status, size, d_err), (t_status, who, t_err) = await asyncio.gather(
        get_dataset(), get_whoami()
    )
    return HubFacts(d_status, size, d_err, t_status, who, t_err)


def hub_checks(plan: Plan, env: Env, hub: HubFacts) -> list[Check]:
    """``dataset.remote`` (when the job has a Hub dataset) and ``hf_token``."""
    checks = []
    ds = plan.dataset
    endpoint = env.hf_endpoint
    if ds is not None:
        where = f"{ds.repo}@{ds.revision}"
        details: dict[str, Any] = {
            "repo": ds.repo,
            "file": ds.file,
            "revision": ds.revision,
            "endpoint": endpoint,
        }
        if hub.dataset == "ok" and hub.dataset_size is not None:
            checks.append(
                make_check(
                    "dataset.remote",
                    PASS,
                    f"{where}: {ds.file}, {format_bytes(hub.dataset_size)}",
                    size=hub.dataset_size,
                    **details,
                )
            )
        elif hub.dataset == "unreachable":
            checks.append(
                make_check(
                    "dataset.remote",
                    WARN,
                    f"Hub unreachable at {endpoint} ({hub.dataset_error}); size unknown",
                    "check the network (and HF_ENDPOINT); staging will fail if it stays down",
                    error=hub.dataset_error,
                    **details,
                )
            )
        else:
            fixes = {
                "missing_file": f"check dataset.file (the files are listed at "
                f"{endpoint}/datasets/{ds.repo}/tree/{ds.revision})",
                "missing_revision": "check dataset.revision (a branch, tag or commit)",
                "gated": f"accept the dataset's terms at {endpoint}/datasets/{ds.repo} with "
                "the HF_TOKEN account",
                "no_access": (
                    "check dataset.repo; if it is private, export HF_TOKEN (read access)"
                    if env.hf_token is None
                    else "check dataset.repo, and that HF_TOKEN's account can read it"
                ),
            }
            value = {
                "missing_file": f"no file {ds.file!r} in {where}",
                "missing_revision": f"no revision {ds.revision!r} in {ds.repo}",
                "gated": f"{ds.repo} is gated",
                "no_access": f"{ds.repo} not found"
                + (
                    " or private (HF_TOKEN is not set)" if env.hf_token is None else " or no access"
                ),
            }.get(hub.dataset, f"{where}: {hub.dataset_error}")
            checks.append(
                make_check(
                    "dataset.remote",
                    FAIL,
                    value,
                    fixes.get(hub.dataset, "see the error in details"),
                    error=hub.dataset_error,
                    **details,
                )
            )
    checks.append(_token_check(plan, env, hub))
    return checks


def _token_check(plan: Plan, env: Env, hub: HubFacts) -> Check:
    sync = plan.sync_hf_repo
    ds = plan.dataset
    private_ds = ds is not None and hub.dataset in ("no_access", "gated")
    if env.hf_token is None:
        if sync is not None:
            return make_check(
                "hf_token",
                FAIL,
                f"HF_TOKEN is not set; sync to hf://{sync} needs a write token",
                f"export HF_TOKEN (a token with write access to {sync}: "
                f"{env.hf_endpoint}/settings/tokens)",
            )
        if private_ds:
            assert ds is not None
            return make_check(
                "hf_token",
                FAIL,
                f"HF_TOKEN is not set; dataset {ds.repo} is private (or missing)",
                f"export HF_TOKEN (a token that can read {ds.repo})",
            )
        why = "dataset is public" if ds is not None else "no Hub dataset or hf:// sync"
        return make_check("hf_token", PASS, f"not set, not needed ({why})")
    if hub.token == "skipped":
        return make_check("hf_token", PASS, "set, not needed (no Hub dataset or hf:// sync)")
    if hub.token == "ok" and hub.whoami is not None:
        who = str(hub.whoami.get("name", "?"))
        access = hub.whoami.get("auth", {}).get("accessToken", {})
        role = access.get("role") if isinstance(access, dict) else None
        details = {"user": who, "role": role}
        if sync is not None and role == "read":
            return make_check(
                "hf_token",
                FAIL,
                f"valid but read-only (user {who}); sync to hf://{sync} needs write access",
                f"create a write token at {env.hf_endpoint}/settings/tokens and export HF_TOKEN",
                **details,
            )
        return make_check(
            "hf_token", PASS, f"valid (user {who}, role {role or 'unknown'})", **details
        )
    if hub.token == "invalid":
        return make_check(
            "hf_token",
            FAIL,
            f"rejected by {env.hf_endpoint} ({hub.token_error})",
            f"create a new token at {env.hf_endpoint}/settings/tokens and export HF_TOKEN",
        )
    return make_check(
        "hf_token",
        WARN,
        f"set, but could not be checked: {hub.token_error}",
        f"check the network and HF_ENDPOINT ({env.hf_endpoint})",
    )
