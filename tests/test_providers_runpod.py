"""The RunPod provider (REST v2) against a fake RunPod API on 127.0.0.1: terminate and stop
confirmed by read-back through 429s with Retry-After, 5xx bursts, hung requests and lingering
state; 409 read back rather than trusted; a wrong key and a missing pod reported at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent.config.model import Env, TeardownSection
from agent.providers import ProviderError
from agent.providers.api import Timing
from agent.providers.runpod import RunPodProvider
from tests.fakes.providers import FakeRunPod, fast_timing, run_fake_runpod

KEY = "runpod-key-0123456789"
POD = "abc123xyz"


@pytest.fixture(params=["404", "TERMINATED"])
def runpod(request: pytest.FixtureRequest) -> Any:
    """Both readings of a terminated pod the contract leaves open."""
    with run_fake_runpod(keys={KEY}, terminated=request.param) as fake:
        fake.add_instance(POD)
        fake.add_instance("other0pod")
        yield fake


def provider(
    fake: FakeRunPod,
    *,
    key: str | None = KEY,
    pod_id: str | None = POD,
    timing: Timing | None = None,
) -> RunPodProvider:
    cfg = TeardownSection(provider="runpod", api_url=fake.url)
    env = Env(runpod_pod_id=pod_id, runpod_api_key=key)
    return RunPodProvider(cfg, env, timing=timing or fast_timing())


def only_this_pod(fake: FakeRunPod) -> None:
    assert fake.mutations(), "no mutating call was made"
    assert all(p.startswith(f"/v2/pods/{POD}") for _, p, _ in fake.mutations()), fake.mutations()
    assert fake.instance("other0pod") is not None


def test_identify_reads_this_pod_and_changes_nothing(runpod: FakeRunPod) -> None:
    ident = asyncio.run(provider(runpod).identify())
    assert (ident.instance_id, ident.source, ident.status) == (
        POD,
        "RUNPOD_POD_ID",
        "status=RUNNING",
    )
    assert ident.price_usd_per_hour == pytest.approx(0.69)
    assert runpod.mutations() == []
    [call] = runpod.requests
    assert (call.method, call.path, call.auth) == ("GET", f"/v2/pods/{POD}", KEY)


def test_terminate_confirmed_through_429_5xx_hang_and_lingering_state(
    runpod: FakeRunPod,
) -> None:
    runpod.fail("delete", 429, times=2, retry_after=1)  # capped by the test timing
    runpod.fail("delete", 500, times=1)
    runpod.fail("get", 502, times=2)
    runpod.hang("get", 1.0, times=1)
    runpod.linger(3)
    result = asyncio.run(provider(runpod).teardown("destroy", "completed"))
    assert result.confirmed and result.performed, result.detail
    assert runpod.instance(POD) is None or runpod.instance(POD)["status"] == "TERMINATED"  # type: ignore[index]
    assert all(m == ("DELETE", f"/v2/pods/{POD}", None) for m in runpod.mutations())
    only_this_pod(runpod)


def test_stop_confirmed_when_the_pod_reads_exited(runpod: FakeRunPod) -> None:
    runpod.fail("action", 503, times=2)
    runpod.linger(2)
    result = asyncio.run(provider(runpod).teardown("stop", "stalled"))
    assert result.confirmed and result.performed, result.detail
    assert "status=EXITED" in result.detail
    # Exactly the v2 body: an extra key would be a 422.
    stop = ("POST", f"/v2/pods/{POD}/action", {"action": "stop"})
    assert all(m == stop for m in runpod.mutations())
    only_this_pod(runpod)


def test_stop_of_an_exited_pod_409_is_confirmed_by_read_back(runpod: FakeRunPod) -> None:
    asyncio.run(provider(runpod).teardown("stop", "stalled"))
    runpod.clear_requests()
    result = asyncio.run(provider(runpod).teardown("stop", "stalled"))
    assert result.confirmed and not result.performed
    assert "409" in result.detail
    assert len(runpod.mutations()) == 1  # not repeated


def test_stop_refused_in_a_state_that_does_not_stop_is_not_confirmed(runpod: FakeRunPod) -> None:
    runpod.add_instance(POD, status="ERROR")
    result = asyncio.run(provider(runpod).teardown("stop", "training_failed"))
    assert not result.confirmed and not result.performed
    assert "409" in result.detail and "not allowed in status ERROR" in result.detail
    assert "status=ERROR" in result.detail


def test_cluster_pod_is_terminated_through_the_action() -> None:
    with run_fake_runpod(keys={KEY}, cluster={POD}) as fake:
        fake.add_instance(POD)
        result = asyncio.run(provider(fake).teardown("destroy", "completed"))
        assert result.confirmed, result.detail
        assert fake.mutations() == [
            ("DELETE", f"/v2/pods/{POD}", None),
            ("POST", f"/v2/pods/{POD}/action", {"action": "terminate"}),
        ]


def test_accepted_but_still_running_is_reported_unconfirmed(runpod: FakeRunPod) -> None:
    runpod.linger(None)
    result = asyncio.run(
        provider(runpod, timing=fast_timing(confirm_s=0.4)).teardown("destroy", "completed")
    )
    assert (result.performed, result.confirmed) == (True, False)
    assert "still reads status=RUNNING" in result.detail
    assert len(runpod.calls("get")) > 2


def test_wrong_key_is_reported_at_once_naming_the_variable(runpod: FakeRunPod) -> None:
    bad = "runpod-wrong-key-000000"
    result = asyncio.run(provider(runpod, key=bad).teardown("stop", "stalled"))
    assert not result.confirmed and not result.performed
    assert "this key cannot act on this instance" in result.detail
    assert "RUNPOD_API_KEY" in result.detail and bad not in result.detail
    assert len(runpod.requests) == 1
    assert runpod.instance(POD)["status"] == "RUNNING"  # type: ignore[index]


def test_pod_not_found(runpod: FakeRunPod) -> None:
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(runpod, pod_id="nosuchpod").identify())
    assert info.value.kind == "not_found"
    assert "RUNPOD_POD_ID" in str(info.value)
    result = asyncio.run(provider(runpod, pod_id="nosuchpod").read_back("destroy"))
    assert result is not None and result.confirmed


def test_missing_variables_are_named() -> None:
    cfg = TeardownSection(provider="runpod", api_url="http://127.0.0.1:9")
    with pytest.raises(ProviderError, match="RUNPOD_API_KEY"):
        asyncio.run(RunPodProvider(cfg, Env(runpod_pod_id=POD)).identify())
    with pytest.raises(ProviderError, match="RUNPOD_POD_ID"):
        asyncio.run(RunPodProvider(cfg, Env(runpod_api_key=KEY)).identify())


def test_problem_json_detail_is_in_the_message(runpod: FakeRunPod) -> None:
    runpod.fail("get", 400, body={"title": "Bad Request", "status": 400, "detail": "bad pod id"})
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(runpod).identify())
    assert "bad pod id" in str(info.value)


# ------------------------------------------------------------------------------------ price


@pytest.mark.parametrize(
    ("fields", "price"),
    [
        (("cost",), 0.69),  # the REST v2 Pod
        (("costPerHr",), 0.69),  # REST v1 / GraphQL
        (("adjustedCostPerHr",), 0.69),  # v1, after discounts
        ((), None),  # no price in the answer: unknown, never an error
    ],
)
def test_the_price_is_read_from_whichever_field_the_pod_carries(
    fields: tuple[str, ...], price: float | None
) -> None:
    with run_fake_runpod(keys={KEY}) as fake:
        fake.add_instance(POD, price_fields=fields)
        ident = asyncio.run(provider(fake).identify())
        body = fake.calls("get")[0]
        assert body.status == 200
        assert ident.price_usd_per_hour == (pytest.approx(price) if price is not None else None)
        assert asyncio.run(provider(fake).price_usd_per_hour()) == ident.price_usd_per_hour
        assert fake.mutations() == []


def test_v2_cost_wins_over_the_v1_fields_and_a_stopped_pod_reads_zero() -> None:
    with run_fake_runpod(keys={KEY}) as fake:
        fake.add_instance(POD, cost=1.25, price_fields=("costPerHr", "cost"))
        assert asyncio.run(provider(fake).identify()).price_usd_per_hour == pytest.approx(1.25)
        fake.add_instance("stopped0pod", status="EXITED", cost=1.25, price_fields=("cost",))
        ident = asyncio.run(provider(fake, pod_id="stopped0pod").identify())
        assert ident.price_usd_per_hour == 0.0  # the contract: 0.0 when EXITED
