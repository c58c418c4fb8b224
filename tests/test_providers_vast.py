"""The Vast provider against a fake Vast API on 127.0.0.1 (tests/fakes/providers.py): destroy
and stop confirmed by read-back through 429s, 5xx bursts, hung requests and lingering state;
wrong keys and missing instances reported at once, naming the variable; keys never shown."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest

from agent.config.jobfile import parse_job
from agent.config.model import Env, TeardownSection
from agent.providers import ProviderError, make_provider
from agent.providers.api import Timing
from agent.providers.vast import VastProvider
from tests.fakes.providers import FakeVast, fast_timing, run_fake_vast

KEY = "vast-account-key-0123456789"
INSTANCE_KEY = "vast-instance-key-abcdefghij"
PATH = "/api/v0/instances/1234/"


@pytest.fixture
def vast() -> Any:
    with run_fake_vast(keys={KEY}, instance_keys={INSTANCE_KEY: "1234"}) as fake:
        fake.add_instance("1234")
        fake.add_instance("999")  # another instance of the same account
        yield fake


def provider(
    fake: FakeVast,
    *,
    key: str | None = INSTANCE_KEY,
    account_key: str | None = None,
    container_id: str | None = "1234",
    timing: Timing | None = None,
    **teardown: Any,
) -> VastProvider:
    cfg = TeardownSection(provider="vast", api_url=fake.url, **teardown)
    env = Env(container_id=container_id, container_api_key=key, vast_api_key=account_key)
    return VastProvider(cfg, env, timing=timing or fast_timing())


def only_this_instance(fake: FakeVast, path: str = PATH) -> None:
    """Every mutating call the fake received named this instance, and no other."""
    assert fake.mutations(), "no mutating call was made"
    assert all(p == path for _, p, _ in fake.mutations()), fake.mutations()


def test_identify_reads_this_instance_and_changes_nothing(vast: FakeVast) -> None:
    ident = asyncio.run(provider(vast).identify())
    assert ident.instance_id == "1234"
    assert ident.source == "CONTAINER_ID"
    assert ident.status is not None and "actual_status=running" in ident.status
    assert ident.price_usd_per_hour == pytest.approx(3.4828)
    assert vast.mutations() == []
    [call] = vast.requests
    assert (call.method, call.path, call.query, call.auth) == (
        "GET",
        PATH,
        {"owner": "me"},
        INSTANCE_KEY,
    )


def test_price_is_the_instances_dph(vast: FakeVast) -> None:
    assert asyncio.run(provider(vast).price_usd_per_hour()) == pytest.approx(3.4828)


def test_identify_reads_the_disk_and_the_storage_price() -> None:
    with run_fake_vast(keys={KEY}) as fake:
        fake.add_instance("1234", disk_space=250.0, storage_cost=0.2)
        ident = asyncio.run(provider(fake, key=None, account_key=KEY).identify())
        assert (ident.disk_gb, ident.storage_usd_per_gb_month) == (250.0, 0.2)
        fake.add_instance("1234", dph_total=None, disk_space=None, storage_cost=None)
        ident = asyncio.run(provider(fake, key=None, account_key=KEY).identify())
        assert (ident.price_usd_per_hour, ident.disk_gb, ident.storage_usd_per_gb_month) == (
            None,
            None,
            None,
        )


def test_destroy_confirmed_through_429_5xx_hang_and_lingering_state(
    vast: FakeVast, caplog: pytest.LogCaptureFixture
) -> None:
    vast.fail("destroy", 429, times=2)  # Vast's plain-text 429, no Retry-After
    vast.fail("destroy", 502, times=1)
    vast.fail("show", 503, times=3)
    vast.hang("show", 1.0, times=1)  # longer than the request timeout
    vast.linger(3)  # accepted, but three reads still show it running
    caplog.set_level(logging.INFO, logger="agent.providers")
    sent: list[str] = []
    result = asyncio.run(provider(vast).teardown("destroy", "completed", on_sent=sent.append))
    assert result.confirmed and result.performed, result.detail
    assert "instances: null" in result.detail
    assert "disk keeps billing" not in result.detail  # destroyed: nothing bills
    assert vast.instance("1234") is None
    assert vast.instance("999") is not None
    only_this_instance(vast)
    assert all(body == {} for method, _, body in vast.mutations() if method == "DELETE")
    assert len(vast.calls("show")) >= 4 + 3  # three failed/hung, then three lingering
    assert len(sent) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("teardown: vast destroy instance 1234 (reason completed)" in m for m in messages)
    assert any("retrying in" in m and "HTTP 429" in m for m in messages)
    assert any("destroy of instance 1234 confirmed" in m for m in messages)


@pytest.mark.parametrize("stopped_status", ["exited", "stopped"])
def test_stop_confirmed_when_actual_status_reads_exited_or_stopped(stopped_status: str) -> None:
    with run_fake_vast(keys={KEY}, stopped_status=stopped_status) as fake:
        fake.add_instance("1234")
        fake.linger(2)
        result = asyncio.run(provider(fake, key=None, account_key=KEY).teardown("stop", "stalled"))
        assert result.confirmed and result.performed, result.detail
        assert fake.mutations() == [("PUT", PATH, {"state": "stopped"})]
        inst = fake.instance("1234")
        assert inst is not None and inst["actual_status"] == stopped_status
        assert f"actual_status={stopped_status}" in result.detail
        # A stop is not free, and the GPUs may not come back: said with the result.
        assert "disk keeps billing" in result.detail
        assert "GPUs are released" in result.detail and "may be gone on restart" in result.detail


def test_intended_stopped_alone_is_not_a_stop(vast: FakeVast) -> None:
    # While the stop lingers the fake shows intended_status=stopped, actual_status=running: a
    # request, not a stopped box. It must keep reading, then say not confirmed.
    vast.linger(None)
    timing = fast_timing(confirm_s=0.5)
    result = asyncio.run(provider(vast, timing=timing).teardown("stop", "stalled"))
    assert not result.confirmed and result.performed
    assert "NOT confirmed" in result.detail
    assert "still reads actual_status=running intended_status=stopped" in result.detail
    assert len(vast.calls("show")) > 2  # kept polling


def test_destroy_accepted_but_still_running_is_reported_unconfirmed(vast: FakeVast) -> None:
    vast.linger(None)
    result = asyncio.run(
        provider(vast, timing=fast_timing(confirm_s=0.5)).teardown("destroy", "completed")
    )
    assert (result.performed, result.confirmed) == (True, False)
    assert "accepted but NOT confirmed" in result.detail
    assert "may still be billing" in result.detail
    assert len(vast.calls("show")) > 2
    only_this_instance(vast)


def test_confirm_alone_reads_back_without_sending(vast: FakeVast) -> None:
    vast.linger(2)
    first = asyncio.run(provider(vast).teardown("destroy", "completed"))
    assert first.confirmed
    vast.clear_requests()
    again = asyncio.run(provider(vast).confirm("destroy"))
    assert again.confirmed
    assert vast.mutations() == []


def test_read_back_before_resending(vast: FakeVast) -> None:
    # A restarted agent asks first: running -> None (send it); gone -> confirmed, nothing sent.
    p = provider(vast)
    assert asyncio.run(p.read_back("destroy")) is None
    asyncio.run(p.teardown("destroy", "completed"))
    vast.clear_requests()
    result = asyncio.run(provider(vast).read_back("destroy"))
    assert result is not None and result.confirmed
    assert vast.mutations() == []


def test_wrong_key_is_reported_at_once_naming_the_variable(vast: FakeVast) -> None:
    bad = "vast-wrong-key-zyxwvutsrq"
    result = asyncio.run(provider(vast, key=bad).teardown("destroy", "completed"))
    assert not result.confirmed and not result.performed
    assert "this key cannot act on this instance" in result.detail
    assert "CONTAINER_API_KEY" in result.detail and "VAST_API_KEY" in result.detail
    assert bad not in result.detail
    assert len(vast.requests) == 1  # a 401 is not retried
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(vast, key=None, account_key=bad).identify())
    assert info.value.kind == "auth"
    assert "VAST_API_KEY" in str(info.value) and bad not in str(info.value)


def test_instance_key_cannot_act_on_another_instance(vast: FakeVast) -> None:
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(vast, container_id="999").identify())
    assert info.value.kind == "auth"
    assert "CONTAINER_ID" in str(info.value)
    assert vast.instance("999") is not None


def test_instance_not_found(vast: FakeVast) -> None:
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(vast, key=None, account_key=KEY, container_id="4242").identify())
    assert info.value.kind == "not_found"
    assert "4242" in str(info.value) and "CONTAINER_ID" in str(info.value)
    # A destroy of an instance that no longer exists: nothing bills; the read-back says so.
    result = asyncio.run(
        provider(vast, key=None, account_key=KEY, container_id="4242").teardown(
            "destroy", "completed"
        )
    )
    assert result.confirmed and not result.performed
    assert "no longer exists" in result.detail or "null" in result.detail


def test_missing_variables_are_named() -> None:
    cfg = TeardownSection(provider="vast", api_url="http://127.0.0.1:9")
    with pytest.raises(ProviderError) as info:
        asyncio.run(VastProvider(cfg, Env(container_id="1234")).identify())
    assert info.value.kind == "config"
    assert "CONTAINER_API_KEY" in str(info.value) and "VAST_API_KEY" in str(info.value)
    with pytest.raises(ProviderError) as info:
        asyncio.run(VastProvider(cfg, Env(vast_api_key=KEY)).identify())
    assert info.value.kind == "config"
    assert "CONTAINER_ID" in str(info.value) and "teardown.instance_id" in str(info.value)


def test_malformed_container_id_never_reaches_a_url(vast: FakeVast) -> None:
    result = asyncio.run(provider(vast, container_id="../999").teardown("destroy", "completed"))
    assert not result.confirmed
    assert vast.requests == []


def test_teardown_instance_id_overrides_container_id(vast: FakeVast) -> None:
    p = provider(vast, key=None, account_key=KEY, container_id="999", instance_id="1234")
    result = asyncio.run(p.teardown("destroy", "completed"))
    assert result.confirmed
    only_this_instance(vast)
    assert vast.instance("999") is not None


def test_429_retries_are_bounded_in_time(vast: FakeVast) -> None:
    vast.fail("show", 429, times=None)
    with pytest.raises(ProviderError) as info:
        asyncio.run(provider(vast, timing=fast_timing(retry_s=0.3)).identify())
    assert info.value.kind == "unavailable"
    assert "HTTP 429" in str(info.value) and "API requests too frequent" in str(info.value)
    assert len(vast.calls("show")) > 2


def test_retry_after_is_honoured(vast: FakeVast) -> None:
    vast.fail("show", 429, retry_after=1, body={"success": False, "error": "rate_limited"})
    asyncio.run(provider(vast, timing=fast_timing(retry_after_max_s=5.0)).identify())
    first, second = vast.calls("show")[:2]
    assert second.at - first.at >= 0.95


def test_keys_are_redacted_from_results_errors_and_logs(
    vast: FakeVast, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    vast.fail(
        "destroy",
        400,
        body={"success": False, "error": "invalid_args", "msg": f"bad request from {INSTANCE_KEY}"},
    )
    result = asyncio.run(provider(vast).teardown("destroy", "completed"))
    assert not result.confirmed
    assert INSTANCE_KEY not in result.detail
    assert "<CONTAINER_API_KEY>" in result.detail
    assert all(INSTANCE_KEY not in r.getMessage() for r in caplog.records)
    assert INSTANCE_KEY not in repr(Env(container_api_key=INSTANCE_KEY))


def test_keep_sends_nothing(vast: FakeVast) -> None:
    result = asyncio.run(provider(vast).teardown("keep", "completed"))
    assert result.confirmed and not result.performed
    assert vast.requests == []


def test_job_file_api_url_and_make_provider(vast: FakeVast) -> None:
    job = parse_job(
        f'[train]\ndata = "/d.yaml"\n[teardown]\nprovider = "vast"\napi_url = "{vast.url}/"\n'
    )
    assert job.teardown.api_url == vast.url
    env = Env(container_id="1234", vast_api_key=KEY)
    p = make_provider(job.teardown, env, timing=fast_timing())
    assert p.name == "vast" and p.can_stop
    result = asyncio.run(p.teardown("destroy", "completed"))
    assert result.confirmed
    only_this_instance(vast)


def test_default_timing_is_bounded() -> None:
    t = Timing()
    assert 0 < t.connect_timeout_s <= t.request_timeout_s <= 60
    assert t.retry_s <= 600 and t.confirm_s <= 900
    assert dataclasses.replace(t, retry_s=1).retry_s == 1


def test_a_404_that_is_not_vasts_own_answer_never_reads_as_destroyed(vast: FakeVast) -> None:
    # A wrong teardown.api_url (or a proxy) answers every path with a bare 404 page. Read as
    # "no such instance", that would record a destroy as confirmed while the box still bills.
    cfg = TeardownSection(provider="vast", api_url=vast.url + "/not-the-api")
    env = Env(container_id="1234", container_api_key=INSTANCE_KEY)
    wrong = VastProvider(cfg, env, timing=fast_timing(retry_s=0.5, confirm_s=0.5))
    result = asyncio.run(wrong.teardown("destroy", "completed"))
    assert not result.confirmed, result.detail
    assert vast.instance("1234") is not None
    assert asyncio.run(wrong.read_back("destroy")) is None
