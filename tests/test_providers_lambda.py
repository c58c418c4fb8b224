"""The Lambda provider against a fake Lambda Cloud API on 127.0.0.1. Lambda's key can terminate
every instance of the account, so the tests that matter most: the box finds itself by its own
address among foreign instances, refuses to guess when two match, and never names another id
in a mutating call; terminate is confirmed by read-back through faults; there is no stop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

from agent.config.model import Env, TeardownSection
from agent.providers import ProviderError
from agent.providers.api import Timing
from agent.providers.lambdalabs import LambdaProvider, local_names, matching
from tests.fakes.providers import FakeLambda, fast_timing, run_fake_lambda

KEY = "lambda-key-0123456789"
OURS = "0920582c7ff041399e34823a0be62549"
FOREIGN = "0920582c7ff041399e34823a0be6254a"
OUR_IP = "203.0.113.7"


@pytest.fixture(params=["status", "404"])
def lam(request: pytest.FixtureRequest) -> Any:
    """A terminated instance reads status terminated, or 404: both end a terminate."""
    with run_fake_lambda(keys={KEY}, terminated=request.param) as fake:
        fake.add_instance(FOREIGN, ip="198.51.100.9", hostname="198-51-100-9")
        fake.add_instance(OURS, ip=OUR_IP, private_ip="10.0.0.5", hostname="203-0-113-7")
        yield fake


def provider(
    fake: FakeLambda,
    *,
    names: Iterable[str] = (OUR_IP, "10.0.0.5", "203-0-113-7"),
    key: str | None = KEY,
    timing: Timing | None = None,
    **teardown: Any,
) -> LambdaProvider:
    cfg = TeardownSection(provider="lambda", api_url=fake.url, on_failure="keep", **teardown)
    return LambdaProvider(
        cfg, Env(lambda_api_key=key), timing=timing or fast_timing(), names=lambda: names
    )


def only_ours(fake: FakeLambda, instance_id: str = OURS) -> None:
    """Every mutating call named exactly this instance and nothing else."""
    assert fake.mutations(), "no mutating call was made"
    for method, path, body in fake.mutations():
        assert (method, path) == ("POST", "/api/v1/instance-operations/terminate")
        assert body == {"instance_ids": [instance_id]}, body


def test_identify_finds_itself_by_ip_among_foreign_instances(lam: FakeLambda) -> None:
    ident = asyncio.run(provider(lam, names=[OUR_IP]).identify())
    assert ident.instance_id == OURS
    assert ident.source == f"matched ip {OUR_IP}"
    assert ident.status == "status=active"
    assert ident.price_usd_per_hour == pytest.approx(1.29)
    assert lam.mutations() == []


@pytest.mark.parametrize(
    ("names", "source"),
    [(["203-0-113-7"], "matched hostname 203-0-113-7"), (["10.0.0.5"], "matched private_ip")],
)
def test_identify_by_hostname_or_private_ip(lam: FakeLambda, names: list[str], source: str) -> None:
    ident = asyncio.run(provider(lam, names=names).identify())
    assert ident.instance_id == OURS
    assert ident.source.startswith(source)


def test_terminate_confirmed_through_faults_naming_only_this_instance(lam: FakeLambda) -> None:
    lam.fail("list", 429, times=2)
    lam.fail("terminate", 502, times=2)
    lam.fail("get", 503, times=2)
    lam.hang("get", 1.0, times=1)
    lam.linger(3)
    sent: list[str] = []
    result = asyncio.run(provider(lam).teardown("destroy", "completed", on_sent=sent.append))
    assert result.confirmed and result.performed, result.detail
    only_ours(lam)
    foreign = lam.instance(FOREIGN)
    assert foreign is not None and foreign["status"] == "active"
    assert sent == ["listed in terminated_instances"]


def test_a_retry_refused_after_a_lost_answer_is_read_back_until_confirmed(
    lam: FakeLambda,
) -> None:
    # The first terminate IS applied but its answer never arrives (timeout); the retry is then
    # refused (the instance is already terminating). That refusal must not end the teardown as
    # "not confirmed": the first attempt may have worked, so the read-back decides.
    lam.hang("terminate", 1.0, after=True)
    lam.linger(3)
    result = asyncio.run(provider(lam).teardown("destroy", "completed"))
    assert result.confirmed, result.detail
    assert [c.status for c in lam.calls("terminate")] == [200, 400]
    only_ours(lam)


def test_two_instances_matching_is_refused_not_guessed(lam: FakeLambda) -> None:
    # The foreign instance reports our address too (a stale record, a NAT): which is ours?
    lam.add_instance(FOREIGN, ip=OUR_IP, hostname="other")
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(lam).identify())
    assert info.value.kind == "ambiguous"
    assert "2 instances match" in str(info.value) and "teardown.instance_id" in str(info.value)
    result = asyncio.run(provider(lam).teardown("destroy", "completed"))
    assert not result.confirmed and not result.performed
    assert lam.mutations() == []


def test_no_instance_matching_is_refused(lam: FakeLambda) -> None:
    result = asyncio.run(provider(lam, names=["192.0.2.99"]).teardown("destroy", "completed"))
    assert not result.confirmed and "no instance of the 2 listed matches" in result.detail
    assert "teardown.instance_id" in result.detail
    assert lam.mutations() == []


def test_a_terminated_instance_with_our_old_address_is_not_us(lam: FakeLambda) -> None:
    lam.add_instance("11111111111111111111111111111111", ip=OUR_IP, status="terminated")
    result = asyncio.run(provider(lam).teardown("destroy", "completed"))
    assert result.confirmed
    only_ours(lam)


def test_instance_id_setting_skips_the_list(lam: FakeLambda) -> None:
    p = provider(lam, names=[], instance_id=OURS)
    assert asyncio.run(p.identify()).source == "teardown.instance_id"
    result = asyncio.run(p.teardown("destroy", "completed"))
    assert result.confirmed
    assert lam.calls("list") == []
    only_ours(lam)


def test_stop_sends_nothing_and_keeps_the_box(lam: FakeLambda) -> None:
    p = provider(lam)
    assert p.can_stop is False
    result = asyncio.run(p.teardown("stop", "training_failed"))
    assert (result.performed, result.confirmed) == (False, False)
    assert "Lambda has no stop" in result.detail and "KEPT" in result.detail
    assert lam.requests == []


def test_still_terminating_is_reported_unconfirmed(lam: FakeLambda) -> None:
    lam.linger(None)
    result = asyncio.run(
        provider(lam, timing=fast_timing(confirm_s=0.4)).teardown("destroy", "completed")
    )
    assert (result.performed, result.confirmed) == (True, False)
    assert "still reads status=terminating" in result.detail
    assert len(lam.calls("get")) > 2
    only_ours(lam)


def test_wrong_key_is_reported_at_once_naming_the_variable(lam: FakeLambda) -> None:
    bad = "lambda-wrong-key-99999999"
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(lam, key=bad).identify())
    assert info.value.kind == "auth"
    message = str(info.value)
    assert "LAMBDA_API_KEY" in message and "global/invalid-api-key" in message
    assert bad not in message
    assert len(lam.requests) == 1


def test_missing_key_is_named() -> None:
    cfg = TeardownSection(provider="lambda", api_url="http://127.0.0.1:9", on_failure="keep")
    with pytest.raises(ProviderError, match="LAMBDA_API_KEY"):
        asyncio.run(LambdaProvider(cfg, Env(), names=lambda: [OUR_IP]).identify())


def test_instance_not_found(lam: FakeLambda) -> None:
    missing = "ffffffffffffffffffffffffffffffff"
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(lam, instance_id=missing).identify())
    assert info.value.kind == "not_found"
    result = asyncio.run(provider(lam, instance_id=missing).read_back("destroy"))
    assert result is not None and result.confirmed


def test_read_back_after_restart_sends_nothing(lam: FakeLambda) -> None:
    assert asyncio.run(provider(lam).teardown("destroy", "completed")).confirmed
    lam.clear_requests()
    # With the id recorded at the first teardown, a restarted agent reads it back directly.
    result = asyncio.run(provider(lam, instance_id=OURS).read_back("destroy"))
    assert result is not None and result.confirmed
    # Found by address: a terminated instance still listed is recognised; one that left the
    # list cannot be told from "not this machine", so the answer is "unknown", never "done".
    by_address = asyncio.run(provider(lam).read_back("destroy"))
    if lam.terminated == "status":
        assert by_address is not None and by_address.confirmed
    else:
        assert by_address is None
    assert lam.mutations() == []


def test_matching_compares_ip_private_ip_and_hostname() -> None:
    listed: list[object] = [
        {"id": "a", "ip": "1.2.3.4", "hostname": "Host-A."},
        {"id": "b", "ip": None, "private_ip": "10.1.1.1"},
        "not an instance",
    ]
    assert [i["id"] for i in matching(listed, ["host-a"])] == ["a"]
    assert [i["id"] for i in matching(listed, ["10.1.1.1"])] == ["b"]
    assert matching(listed, ["9.9.9.9"]) == []


def test_local_names_leave_out_loopback() -> None:
    names = local_names()
    assert "127.0.0.1" not in names and "::1" not in names and "localhost" not in names
