"""The event bus: order, late subscribers, slow subscribers, listeners that fail."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agent.events import EventBus


def test_subscribers_get_events_in_order_and_late_ones_get_the_kept_history() -> None:
    async def main() -> None:
        bus = EventBus(history=3)
        early = bus.subscribe()
        for n in range(5):
            bus.publish("epoch", epoch=n)
        got = [(await early.get()).data["epoch"] for _ in range(5)]
        assert got == [0, 1, 2, 3, 4]
        late = bus.subscribe()  # only the 3 kept
        assert [(await late.get()).data["epoch"] for _ in range(3)] == [2, 3, 4]
        newer = bus.subscribe(since=4)  # seq 5 only
        assert (await newer.get()).seq == 5
        assert [e.seq for e in bus.recent(since=3)] == [4, 5]

    asyncio.run(main())


def test_a_slow_subscriber_loses_its_oldest_events_and_is_told() -> None:
    async def main() -> None:
        bus = EventBus()
        slow = bus.subscribe(maxsize=2)
        for n in range(5):
            bus.publish("epoch", epoch=n)
        gap = await slow.get()
        assert gap.kind == "gap" and gap.data == {"dropped": 3}
        assert [(await slow.get()).data["epoch"] for _ in range(2)] == [3, 4]

    asyncio.run(main())


def test_close_ends_iteration_and_a_failing_listener_never_fails_publish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        bus = EventBus()
        seen: list[str] = []

        def bad(_event: object) -> None:
            raise RuntimeError("listener bug")

        bus.listen(bad)
        bus.listen(lambda e: seen.append(e.kind))
        sub = bus.subscribe()
        with caplog.at_level(logging.ERROR, logger="agent.events"):
            bus.publish("phase", to="TRAINING")
        assert seen == ["phase"]
        assert "event listener failed on phase" in caplog.text
        bus.close()
        got = [e.kind async for e in sub]
        assert got == ["phase"]

    asyncio.run(main())
