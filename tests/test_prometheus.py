"""agent/status/prometheus.py: ``GET /metrics`` follows Prometheus' naming rules
(https://prometheus.io/docs/practices/naming/) and exports what the /status document holds.

The rules are checked by ``promtool check metrics`` where it is installed, and always by the
rules written out below over prometheus-client's own parser: Debian ships promtool only in the
``prometheus`` package (the server and its web assets, about 94 MB installed), too heavy for CI.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.status.prometheus import PREFIX, RENAMED
from agent.status.views import render
from tests.test_daemon_loop import make
from tests.test_metrics import DOC, NOW, samples

README = Path(__file__).resolve().parents[1] / "README.md"

#: Base units (the naming page's table): a name may end with one, never begin with one.
BASE_UNITS = ("seconds", "bytes", "ratio", "meters", "volts", "amperes", "joules", "grams")
#: Units that are not base units, and abbreviations: never a word of a name (promtool's lint
#: says the same). ``hour`` (singular) stays allowed: prices are quoted per hour.
NOT_BASE = frozenset(
    {
        *("s", "ms", "us", "ns", "sec", "secs", "msec", "millis"),
        *("milliseconds", "microseconds", "nanoseconds", "minutes", "mins", "hours", "days"),
        *("weeks", "percent", "pct", "bits", "kb", "mb", "gb", "kib", "mib", "gib"),
        *("kilobytes", "megabytes", "gigabytes"),
    }
)
#: Labels Prometheus sets on every series it scrapes: ours would be renamed ``exported_job``.
RESERVED_LABELS = frozenset({"job", "instance"})
SNAKE = re.compile(r"[a-z][a-z0-9_]*")


def naming_problems(text: str) -> list[str]:
    """Every break of the naming rules in an exposition (0.0.4 text format), one line each."""
    problems: list[str] = []
    helps: dict[str, int] = {}
    types: dict[str, str] = {}
    sampled: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP ") :].partition(" ")
            helps[name] = helps.get(name, 0) + 1
            if not help_text.strip():
                problems.append(f"{name}: empty HELP")
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            if name in types:
                problems.append(f"{name}: two TYPE lines")
            types[name] = kind
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    for name in sampled - set(types):
        problems.append(f"{name}: a sample without a TYPE line")
    for name, kind in types.items():
        if helps.get(name) != 1:
            problems.append(f"{name}: {helps.get(name, 0)} HELP lines")
        if name not in sampled:
            problems.append(f"{name}: a family without samples")
        if not (SNAKE.fullmatch(name) and name.startswith(PREFIX)):
            problems.append(f"{name}: not a snake_case name under {PREFIX}")
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f"{name}: a counter without _total")
        if kind != "counter" and name.endswith("_total"):
            problems.append(f"{name}: _total on a {kind}")
        for unit in BASE_UNITS:
            if name.startswith(f"{PREFIX}{unit}_"):
                problems.append(f"{name}: the unit {unit} as a prefix, not a suffix")
        for word in name.removeprefix(PREFIX).split("_"):
            if word in NOT_BASE:
                problems.append(f"{name}: {word!r} is not a base unit")
    for family in text_string_to_metric_families(text):
        # The parser names a counter without its _total; HELP is the family's.
        name = family.name
        words = family.documentation.lower()
        bare = name.removesuffix("_total")
        for unit, said in (("seconds", "seconds"), ("bytes", "bytes"), ("ratio", "0 to 1")):
            if said in words and not bare.endswith(f"_{unit}"):
                problems.append(f"{name}: HELP speaks of {said}, the name has no _{unit}")
        if name.endswith("_info") and (
            family.type != "gauge" or any(s.value != 1 for s in family.samples)
        ):
            problems.append(f"{name}: an _info series is a gauge of 1")
        for s in family.samples:
            for label in s.labels:
                if label in RESERVED_LABELS or label.startswith("__"):
                    problems.append(f"{name}: label {label!r} is Prometheus' own")
                if not SNAKE.fullmatch(label):
                    problems.append(f"{name}: label {label!r} is not snake_case")
    samples(text)  # no series twice (asserts)
    return problems


#: DOC plus every part of the document that the exposition reads.
FULL: dict[str, Any] = {
    **json.loads(json.dumps(DOC)),
    "started_at": NOW - 3600,
    "state_write_error": None,
    "teardown_open": False,
    "sizing": {"verdict": {"bound": "gpu", "gpu_util": 38.0, "wrong_box": False}},
    "notify": {"webhook": "https://hooks.example/...", "sent": 5, "failed": 1, "dropped": 0},
}
FULL["supervision"].update(
    box_fault=None,
    preemption={
        "sources": ["aws"],
        "notice": {"source": "aws", "message": "terminate", "at": NOW - 10, "action_at": NOW + 110},
    },
)
#: Two H200s as the stall watch last sampled them (GpuSample.as_dict); GPU 1 gave no memory.
GPUS = [
    {
        "index": 0,
        "util_pct": 97.0,
        "power_w": 650.0,
        "power_limit_w": 700.0,
        "memory_used_bytes": 30_000_000_000,
        "memory_total_bytes": 150_754_820_096,
        "busy": True,
    },
    {
        "index": 1,
        "util_pct": 95.0,
        "power_w": 640.0,
        "power_limit_w": 700.0,
        "memory_used_bytes": None,
        "memory_total_bytes": None,
        "busy": True,
    },
]
FULL["supervision"]["stall"] = {**FULL["supervision"]["stall"], "gpus": GPUS}
FULL["sync"]["last_success_at"] = NOW - 30
FULL["sync"]["bytes_per_s"] = 5_000_000.0
FULL["money"]["stopped_usd_per_hour"] = 0.02
FULL["steering"] = {"extended_s": 1800.0, "hold": {"active": True, "remaining_s": 600.0}}


def test_the_naming_rules_catch_the_old_names() -> None:
    """The check above can fail: the exposition of the previous version breaks it."""
    old = (
        "# HELP libreyolo_agent_seconds_to_deadline seconds until the deadline\n"
        "# TYPE libreyolo_agent_seconds_to_deadline gauge\n"
        "libreyolo_agent_seconds_to_deadline 10.0\n"
        "# HELP libreyolo_agent_job_info the job\n"
        "# TYPE libreyolo_agent_job_info gauge\n"
        'libreyolo_agent_job_info{job="run1"} 1.0\n'
        "# HELP libreyolo_agent_resumes times the trainer was resumed\n"
        "# TYPE libreyolo_agent_resumes counter\n"
        "libreyolo_agent_resumes 1.0\n"
        "# TYPE libreyolo_agent_quiet_s gauge\n"
        "libreyolo_agent_quiet_s 3.0\n"
    )
    got = "\n".join(naming_problems(old))
    assert "seconds_to_deadline: the unit seconds as a prefix" in got
    assert "HELP speaks of seconds" in got
    assert "label 'job' is Prometheus' own" in got
    assert "libreyolo_agent_resumes: a counter without _total" in got
    assert "libreyolo_agent_quiet_s: 0 HELP lines" in got
    assert "'s' is not a base unit" in got


@pytest.mark.parametrize(
    "doc",
    [FULL, DOC, {"phase": "BOOTING", "sync": None, "money": None}],
    ids=["full", "mid-training", "booting"],
)
def test_the_exposition_follows_the_naming_rules(doc: dict[str, Any]) -> None:
    assert naming_problems(render(doc).decode()) == []


def test_a_real_daemons_document_follows_the_naming_rules_and_counts_its_resumes(
    tmp_path: Path,
) -> None:
    """The document as the daemon builds it: ``resumes`` is state.json's list of records."""
    daemon, *_ = make(tmp_path)
    daemon.state.resumes += [
        {"at": 1.0, "epoch": 2, "kind": "crash", "message": "CUDA error"},
        {"at": 2.0, "epoch": 5, "kind": "preempted", "message": "spot"},  # does not count
    ]
    text = render(daemon.status_dict()).decode()
    assert naming_problems(text) == []
    got = samples(text)
    assert got[(PREFIX + "resumes_total", ())] == 2
    assert got[(PREFIX + "restarts_remaining", ())] == 3 - 1  # max_restarts defaults to 3
    assert got[(PREFIX + "job_info", (("job_name", "run1"),))] == 1
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds[PREFIX + "resumes"] == "counter"


def test_no_resumes_is_a_zero_and_used_up_restarts_never_go_negative() -> None:
    doc = json.loads(json.dumps(DOC))
    doc["supervision"]["resumes"] = []
    got = samples(render(doc).decode())
    assert got[(PREFIX + "resumes_total", ())] == 0
    assert got[(PREFIX + "restarts_remaining", ())] == 3
    doc["supervision"]["resumes"] = [{"kind": "crash"}] * 5
    got = samples(render(doc).decode())
    assert got[(PREFIX + "resumes_total", ())] == 5
    assert got[(PREFIX + "restarts_remaining", ())] == 0


def test_what_a_dashboard_wants_from_the_document_is_exported() -> None:
    got = samples(render(FULL).decode())
    want = {
        "start_time_seconds": NOW - 3600,
        "trainer_start_time_seconds": NOW - 600,
        "state_write_failing": 0,
        "teardown_open": 0,
        "box_fault": 0,
        "preemption_notice": 1,
        "preemption_action_timestamp_seconds": NOW + 110,
        "gpu_utilization_ratio": 0.38,
        "last_upload_timestamp_seconds": NOW - 30,
        "upload_bytes_per_second": 5_000_000.0,
        "stopped_price_usd_per_hour": 0.02,
        "extended_seconds": 1800.0,
        "hold_remaining_seconds": 600.0,
        "notifications_sent_total": 5,
        "notifications_failed_total": 1,
        "notifications_dropped_total": 0,
    }
    assert {name: got[(PREFIX + name, ())] for name in want} == want


def test_gpu_memory_is_exported_per_gpu_in_bytes() -> None:
    text = render(FULL).decode()
    got = samples(text)
    assert got[(PREFIX + "gpu_memory_used_bytes", (("gpu", "0"),))] == 30_000_000_000
    assert got[(PREFIX + "gpu_memory_total_bytes", (("gpu", "0"),))] == 150_754_820_096
    # A figure NVML did not give is left out, never a 0.
    assert (PREFIX + "gpu_memory_used_bytes", (("gpu", "1"),)) not in got
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds[PREFIX + "gpu_memory_used_bytes"] == "gauge"
    # No sample (no NVML, or before the first): no family at all, not an empty one.
    assert "gpu_memory" not in render(DOC).decode()


def test_a_failing_state_write_and_an_open_teardown_show() -> None:
    doc = {**FULL, "state_write_error": "ENOSPC", "teardown_open": True}
    got = samples(render(doc).decode())
    assert got[(PREFIX + "state_write_failing", ())] == 1
    assert got[(PREFIX + "teardown_open", ())] == 1


def test_renamed_series_are_gone_and_the_readme_names_each_rename() -> None:
    text = render(FULL).decode()
    names = {name for name, _ in samples(text)}
    labels = {label for _, key in samples(text) for label, _ in key}
    readme = README.read_text()
    for old, new in RENAMED.items():
        old_name, _, old_label = old.partition("{")
        new_name = new.partition("{")[0]
        if old_name != new_name:
            assert old_name not in names, old
        assert new_name in names, new
        if old_label:
            assert old_label.rstrip("}") not in labels, old
        # The README's table shortens names to their part after ``libreyolo_agent``.
        assert f"`_{old.removeprefix(PREFIX)}`" in readme, old
        assert f"`_{new.removeprefix(PREFIX)}`" in readme, new


def test_promtool_check_metrics_passes() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool is not installed (Debian's prometheus package, about 94 MB installed, "
            "is too heavy for CI); the naming rules of this file stand in for it"
        )
    for doc in (FULL, DOC):
        result = subprocess.run(
            [promtool, "check", "metrics"],
            input=render(doc),
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.strip() == b"", result.stdout
