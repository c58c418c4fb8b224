from __future__ import annotations

import os
import signal
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from tests import leftovers

# Test traffic goes to 127.0.0.1 only; the Hub client is httpx, which honours proxies.
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("no_proxy", "127.0.0.1,localhost")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_XET"] = "1"
# The suite runs on several workers (pytest -n 4): a real trainer's torch would start a
# thread per core in each, and they would spin against each other. One thread per trainer here;
# a user's trainer keeps torch's own choice (the agent sets nothing).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What the agent builds (the C NVML host, agent/gpu/nvmlhost.py) goes to a folder of the suite's,
# not the user's ~/.cache: shared by the workers (a build is an atomic rename), per user.
os.environ.setdefault(
    "LIBREYOLO_AGENT_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"libreyolo-agent-tests-cache-{os.getuid()}"),
)

# Ctrl-C as a terminal gives it, whoever started the suite: a runner that starts it with `cmd &`
# from a script leaves SIGINT ignored, and an ignored signal is passed on to every child the tests
# start (a `logs --follow` ended by SIGINT then never ends). Only the first in-process Daemon of
# a worker would set it back (asyncio's remove_signal_handler), so which tests saw it depended on
# the order the files reached the worker. agent/trainer/spawn.py gives the trainer its defaults
# whatever it inherits (tests/test_trainer.py ignores SIGINT on purpose to prove it).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: The per-test cap of a test that trains for real (``@pytest.mark.training``), unless it names
#: its own: a real ``libreyolo train`` on a loaded 2-core machine takes minutes where it takes
#: seconds idle. A cap only for a hang; every wait inside waits on a state.
TRAINING_TIMEOUT_S = 900


def pytest_configure(config: pytest.Config) -> None:
    # A leftover is killed and reported as a warning; the project's "error" filter would turn
    # the report into a teardown error of a test that may well have passed (appended: it wins).
    config.addinivalue_line("filterwarnings", "default::tests.leftovers.LeftoverProcessWarning")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pyproject's `timeout` (300 s) is sized for tests that do not train; the training ones get
    # a cap of their own, so their verdict never depends on the machine's load.
    for item in items:
        if item.get_closest_marker("training") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(TRAINING_TIMEOUT_S))

    # The long poles first. The suite runs each file on one worker (`--dist loadfile`), handed
    # out in the order of the files' first tests: a file whose fixture is a real install
    # (its xdist_group mark), then the files with the most tests that train (test_daemon,
    # test_restart...: minutes each), then the rest. So the heavy files run beside the short
    # ones instead of alone at the end. A stable sort: every worker collects the same order.
    training: dict[str, int] = {}
    grouped: set[str] = set()
    for item in items:
        path = item.nodeid.partition("::")[0]
        if item.get_closest_marker("training"):
            training[path] = training.get(path, 0) + 1
        if item.get_closest_marker("xdist_group"):
            grouped.add(path)

    def pole(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.partition("::")[0]
        return (0 if path in grouped else 1, -training.get(path, 0))

    items.sort(key=pole)


@pytest.fixture(autouse=True)
def _ends_its_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every process a test started ends with it, pass or fail (tests/leftovers.py): the test's
    processes inherit a tag in their environment (so those in sessions of their own, which leave
    the pytest process's tree once their parent dies, are found too); after the test, whatever
    still runs with the tag, or descends from pytest and was born during the test, is killed
    and listed in a warning."""
    tag = uuid.uuid4().hex
    before = os.environ.get(leftovers.TAG_ENV)
    started = leftovers.now_ticks()
    os.environ[leftovers.TAG_ENV] = tag
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(leftovers.TAG_ENV, None)
        else:
            os.environ[leftovers.TAG_ENV] = before
        killed = leftovers.end_leftovers(tag, started)
        if killed:
            leftovers.report(request.node.nodeid, killed)
