"""The CLI as a person and a script meet it (issue 28): every subcommand's help has a description
and the exit codes the README's Commands table gives; ``--json`` on the control commands;
``token``; ``status`` naming the teardown plan before the decision; ``check`` suggesting a
misspelt section; no BrokenPipe traceback when any command is piped to ``head``; a syslog
priority on the error line when stderr is the journal. All through the real CLI in subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import build_parser
from agent.state import Phase, Reason
from tests.test_cli import (
    CONTROL_TOKEN,
    PREFIX,
    TEARDOWN,
    Docs,
    agent_endpoint,
    cli,
    save_state,
    serving,
    status_doc,
    write_job,
)

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def subcommands() -> list[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sorted(sub.choices)  # type: ignore[arg-type]


def readme_exit_codes() -> dict[str, set[str]]:
    """The exit codes each command's row of the README's Commands table gives (a command with
    two rows, like ``cost``, gets the union)."""
    text = README.read_text(encoding="utf-8")
    table = text.split("## Commands", 1)[1].split("\n\n", 2)[1]
    codes: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        name = re.match(r"`libreyolo-agent (\w+)", cells[0])
        assert name is not None, row
        found = set(re.findall(r"(?:^|, )(\d)\b", cells[-1]))
        codes.setdefault(name.group(1), set()).update(found)
    return codes


def help_exit_codes(text: str) -> set[str]:
    block = text.split("exit codes:\n", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^  (\d)  ", block, re.M))


@pytest.mark.parametrize("command", subcommands())
def test_every_subcommands_help_has_a_description_and_the_readmes_exit_codes(
    tmp_path: Path, command: str
) -> None:
    proc = cli(tmp_path, command, "--help")
    assert proc.returncode == 0, proc.stderr
    usage, description = proc.stdout.split("\n\n", 2)[:2]
    assert usage.startswith("usage: "), proc.stdout
    assert len(description) > 40 and not description.startswith("options:"), proc.stdout
    assert "exit codes:\n" in proc.stdout, proc.stdout
    readme = readme_exit_codes()
    assert command in readme, f"no row for {command} in the README's Commands table"
    assert help_exit_codes(proc.stdout) == readme[command], proc.stdout


# ------------------------------------------------------------------------------- --json


@pytest.mark.parametrize(
    ("action", "args", "key"),
    [
        ("stop", (), "message"),
        ("extend", ("2h",), "deadline_at"),
        ("hold", ("1h",), "hold"),
    ],
)
def test_json_prints_the_agents_answer(
    tmp_path: Path, action: str, args: tuple[str, ...], key: str
) -> None:
    job = write_job(tmp_path, "")  # not read: the agent's address comes from the state dir
    assert job.exists()
    with agent_endpoint(tmp_path):
        proc = cli(tmp_path, action, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["action"] == action
    assert key in doc, doc


def test_json_of_a_refusal_is_a_document_too(tmp_path: Path) -> None:
    with agent_endpoint(tmp_path):
        proc = cli(tmp_path, "release", "--json")  # nothing is held: 409
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["action"] == "release" and doc["http_status"] == 409
    assert proc.stderr == PREFIX + doc["error"] + "\n"


def test_json_with_no_agent_says_so(tmp_path: Path) -> None:
    save_state(tmp_path / "state", Phase.TRAINING, 9)
    (tmp_path / "state" / "token").write_text(CONTROL_TOKEN)
    proc = cli(tmp_path, "stop", "--json", "--url", "http://127.0.0.1:9")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and "no agent answers" in doc["error"]


# ------------------------------------------------------------------------------- token


def test_token_prints_the_token_and_a_login_url_for_the_agents_port(tmp_path: Path) -> None:
    save_state(tmp_path / "state", Phase.TRAINING, 8555)
    (tmp_path / "state" / "token").write_text(CONTROL_TOKEN + "\n")
    proc = cli(tmp_path, "token")
    assert (proc.returncode, proc.stdout) == (0, CONTROL_TOKEN + "\n"), proc.stderr
    proc = cli(tmp_path, "token", "--login-url")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"http://localhost:8555/#token={CONTROL_TOKEN}\n"


def test_token_without_one_is_one_line_and_exit_1(tmp_path: Path) -> None:
    # No agent ever ran with this state directory: said so, with the fix (not "run as the
    # agent's user", which is the fix for a token that is there but unreadable).
    proc = cli(tmp_path, "token")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"{PREFIX}no control token in {tmp_path / 'state'}: no agent has run with this state "
        "directory; pass --state-dir (or set LIBREYOLO_AGENT_STATE_DIR) to the one the agent "
        "uses\n"
    )
    stop = cli(tmp_path, "stop")
    assert stop.returncode == 1 and stop.stderr.startswith(f"{PREFIX}no control token in ")
    # A token that is there but cannot be read (here a folder in its place; as root, mode
    # bits would not stop the read): the other fix.
    (tmp_path / "state" / "token").mkdir(parents=True)
    proc = cli(tmp_path, "token")
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(PREFIX + "cannot read the control token in ")
    assert "run as the agent's user or pass --state-dir" in proc.stderr


# ------------------------------------------------------------------------------ status


PLAN = {
    "provider": "vast",
    "on_success": "destroy",
    "on_failure": "stop",
    "require_verified_sync": True,
}


def status_rows(stdout: str) -> dict[str, str]:
    return {line[:18].strip(): line[19:] for line in stdout.splitlines()}


def test_status_names_the_teardown_plan_before_the_decision(tmp_path: Path) -> None:
    with serving(tmp_path, Docs(status_doc(teardown_plan=PLAN))):
        proc = cli(tmp_path, "status")
    assert proc.returncode == 0, proc.stderr
    assert status_rows(proc.stdout)["teardown"] == (
        "when training ends: destroy (vast) if every checkpoint is verified, else stop; "
        "after a failure: stop (vast)"
    )


def test_status_names_the_decision_once_made(tmp_path: Path) -> None:
    decided = {"action": "destroy", "confirmed": True, "detail": "destroyed instance 42"}
    with serving(tmp_path, Docs(status_doc(teardown_plan=PLAN, teardown=decided))):
        proc = cli(tmp_path, "status")
    assert proc.returncode == 0, proc.stderr
    assert "destroyed instance 42" in status_rows(proc.stdout)["teardown"]
    assert "when training ends" not in proc.stdout


def test_a_provider_without_stop_keeps_the_box_when_not_verified(tmp_path: Path) -> None:
    plan = {**PLAN, "provider": "lambda", "on_failure": "destroy"}
    with serving(tmp_path, Docs(status_doc(teardown_plan=plan))):
        proc = cli(tmp_path, "status")
    assert status_rows(proc.stdout)["teardown"] == (
        "when training ends: destroy (lambda) if every checkpoint is verified, else keep "
        "(it has no stop)"
    )


# ------------------------------------------------------------------------------- check


def test_check_suggests_a_misspelt_section(tmp_path: Path) -> None:
    text = '[train]\ndata = "/data/set/data.yaml"\n[trian]\nepochs = 3\n[teardwon]\n'
    proc = cli(tmp_path, "check", "--offline", str(write_job(tmp_path, text)))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(PREFIX + "teardwon: unknown section; did you mean [teardown]? ")
    assert lines[1].startswith(PREFIX + "trian: unknown section; did you mean [train]? ")
    proc = cli(tmp_path, "check", "--offline", str(write_job(tmp_path, text + "[zzzz]\n")))
    assert PREFIX + "zzzz: unknown section (expected one of: job, train," in proc.stderr


# ------------------------------------------------------------------- a reader gone away


def with_closed_stdout(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``libreyolo-agent ARGS | head -1``, the reader gone before the command writes."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(
            [sys.executable, "-m", "agent.cli", *args],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={
                "PATH": "/usr/bin:/bin",
                "HOME": str(tmp_path),
                "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state"),
            },
            timeout=60,
        )
    finally:
        os.close(w)


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("status", "--help"),
        ("status",),
        ("status", "--json"),
        ("status", "--watch"),
        ("logs",),
        ("logs", "--follow"),
        ("token",),
        ("token", "--login-url"),
        ("check", "--offline", "JOB"),
        ("cost", "--disk-gb", "250", "--storage-usd-per-gb-month", "0.2", "--rebuild-usd", "1"),
    ],
)
def test_no_command_prints_a_traceback_to_a_reader_that_went_away(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    state = tmp_path / "state"
    save_state(state, Phase.DONE, 9, reason=Reason.COMPLETED, teardown=TEARDOWN)
    (state / "token").write_text(CONTROL_TOKEN)
    (state / "agent.log").write_text("a line\n")
    job = str(write_job(tmp_path, '[train]\ndata = "/data/set/data.yaml"\n'))
    proc = with_closed_stdout(tmp_path, *(job if a == "JOB" else a for a in args))
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    # The commands say 1 (what they had to say was not read); a log's reader going away is
    # how `logs` ends.
    assert proc.returncode == (0 if args[0] == "logs" else 1), proc.stderr


def test_status_piped_to_head_prints_its_first_line_only(tmp_path: Path) -> None:
    save_state(tmp_path / "state", Phase.DONE, 9, reason=Reason.COMPLETED, teardown=TEARDOWN)
    proc = subprocess.run(
        f"{sys.executable} -m agent.cli status | head -1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state")},
        timeout=60,
    )
    assert proc.stdout.startswith("no agent is running;") and proc.stdout.count("\n") == 1
    assert "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ journald


def test_an_error_carries_its_syslog_priority_only_when_stderr_is_the_journal(
    tmp_path: Path,
) -> None:
    args = [sys.executable, "-m", "agent.cli", "cost", "--disk-gb", "x"]
    err_file = tmp_path / "stderr"
    with open(err_file, "w") as f:
        st = os.fstat(f.fileno())
        env = {"PATH": "/usr/bin:/bin", "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        code = subprocess.run(args, stderr=f, cwd=REPO, env=env, timeout=60).returncode
    assert code == 2
    assert err_file.read_text().startswith("<3>" + PREFIX)
    plain = subprocess.run(
        args, capture_output=True, text=True, cwd=REPO, env={"PATH": "/usr/bin:/bin"}, timeout=60
    )
    assert plain.stderr.startswith(PREFIX)
