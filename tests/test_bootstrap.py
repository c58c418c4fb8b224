"""Every start line the docs give, run twice, and bootstrap.sh with a job that fails its check.

The start lines are taken from the docs themselves (README, docs/recipes.md, examples/ and the
header of scripts/bootstrap.sh): every line of a code block that runs ``git clone``, up to the
``bootstrap.sh`` it starts, with ``bash -c`` and cloud-init ``runcmd`` wrappers unwrapped. Each is
run with a local repository (a clone of this checkout, with the working tree's scripts) as
``LIBREYOLO_AGENT_REPO``, temporary folders in place of ``/opt/...``, ``/etc/libreyolo-agent`` and
``/var/lib/libreyolo-agent``, and ``--no-install``: the virtual environment is a fresh one that
sees this interpreter's packages (nothing is downloaded), and whose ``libreyolo`` is the scripted
stand-in trainer, held at its first epoch (a job that waits instead of training).

The first run clones (over a clone left half-made) and starts the real supervisor and agent; the
second is a no-op that leaves them alone; after they died, a third run starts them again. Every
process a test starts carries a marker in its environment and is killed at the end, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = ROOT / "scripts" / "bootstrap.sh"
TRAINER = ROOT / "tests" / "fakes" / "scripted_trainer.py"
TOKEN = "hf_bootstrap_test_secret_4242"
MARK = "LIBREYOLO_TEST_BOOTSTRAP_MARK"
# The paths the docs use on a box, and what they become in a test.
BOX_PATHS = ("/opt/libreyolo-agent", "/etc/libreyolo-agent", "/var/lib/libreyolo-agent")

# One worker builds the module fixtures (a git repo, a venv) and runs every test of the file
# (the README's test command distributes with `--dist loadfile`).
pytestmark = [
    pytest.mark.skipif(shutil.which("git") is None, reason="needs git"),
    pytest.mark.xdist_group("bootstrap"),
]


# ------------------------------------------------------------------ the start lines of the docs


def _doc_scripts() -> list[tuple[str, str]]:
    """(where, script) for every code block of the docs, unwrapped: bash ``-c`` one-liners and
    cloud-init runcmd entries give their inner script too."""
    found: list[tuple[str, str]] = []
    docs = [ROOT / "README.md", ROOT / "docs" / "recipes.md"]
    docs += sorted(p for p in (ROOT / "examples").rglob("*") if p.suffix in (".md", ".sh"))
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        for lang, block in re.findall(r"^ *```(\w*)\n(.*?)^ *```", text, flags=re.S | re.M):
            where = f"{doc.relative_to(ROOT)}"
            found.append((where, block))
            if lang == "yaml" and block.startswith("#cloud-config"):
                for cmd in yaml.safe_load(block).get("runcmd") or []:
                    if isinstance(cmd, list) and cmd[:2] == ["bash", "-c"]:
                        found.append((f"{where} (runcmd)", cmd[2]))
            for line in block.splitlines():
                if line.lstrip().startswith("bash -c"):
                    words = shlex.split(line, comments=True)
                    if len(words) >= 3 and words[:2] == ["bash", "-c"]:
                        found.append((f"{where} (bash -c)", words[2]))
    header = BOOTSTRAP.read_text(encoding="utf-8").split("\nset -euo pipefail", 1)[0]
    comment = "\n".join(re.sub(r"^# ?", "", line) for line in header.splitlines()[1:])
    found.append(("scripts/bootstrap.sh --help", comment))
    return found


def start_lines() -> dict[str, list[str]]:
    """Each documented start statement (from its line's start to the end of the bootstrap.sh
    command), and where the docs give it: the ``git clone`` lines of the scripts that start
    ``bootstrap.sh`` (a laptop's clone is not a box's start). A ``git clone`` line without
    ``bootstrap.sh`` on it is a start line split over several lines: it is kept whole, and
    fails the one-line rule."""
    lines: dict[str, list[str]] = {}
    for where, script in _doc_scripts():
        if "bootstrap.sh" not in script:
            continue
        for line in script.splitlines():
            if "git clone" not in line or line.lstrip().startswith(("bash -c", "- [bash")):
                continue
            m = re.match(r"\s*(.*?scripts/bootstrap\.sh\"?)", line)
            stmt = m.group(1) if m else line.strip()
            lines.setdefault(stmt, []).append(where)
    return lines


START_LINES = start_lines()


def test_the_docs_give_start_lines_everywhere_a_box_is_started() -> None:
    places = {w for ws in START_LINES.values() for w in ws}
    assert any(w.startswith("README.md") for w in places), places
    assert any(w.startswith("scripts/bootstrap.sh") for w in places), places
    # Vast's script, RunPod's bash -c, Lambda's and AWS's runcmd, GCP's startup script.
    recipes = [w for ws in START_LINES.values() for w in ws if w.startswith("docs/recipes.md")]
    assert len(recipes) >= 6, START_LINES


@pytest.mark.parametrize("stmt", sorted(START_LINES), ids=lambda s: f"{len(s)}-chars")
def test_every_start_line_is_one_line_that_keeps_a_complete_clone(stmt: str) -> None:
    # One line (RunPod's field and cloud-init's runcmd take one), ending in bootstrap.sh, and the
    # clone guarded: a plain `git clone X DIR && ...` fails at the second boot (exit 128).
    assert stmt.endswith(("bootstrap.sh", 'bootstrap.sh"')), (stmt, START_LINES[stmt])
    assert re.search(r"\[ -d \S*\.git\"? \] \|\|", stmt), (stmt, START_LINES[stmt])


# ------------------------------------------------------------------ the box in a temporary folder


@pytest.fixture(scope="module")
def repo_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A bare repository holding this checkout's HEAD plus the working tree's scripts (so the
    bootstrap.sh under test is the one on disk, committed or not)."""
    base = tmp_path_factory.mktemp("repo")
    src = base / "src"

    def git(*args: str) -> None:
        ident = ["-c", "user.name=test", "-c", "user.email=test@127.0.0.1"]
        subprocess.run(["git", *ident, *args], check=True, capture_output=True, timeout=300)

    git("clone", "-q", "--depth", "1", ROOT.as_uri(), str(src))
    for name in ("scripts", "install.sh"):
        target = src / name
        if target.is_dir():
            shutil.rmtree(target)
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, target)
    git("-C", str(src), "add", "-A", "scripts", "install.sh")
    git("-C", str(src), "commit", "-q", "--allow-empty", "-m", "the working tree's scripts")
    bare = base / "libreyolo-agent.git"
    git("clone", "-q", "--bare", str(src), str(bare))
    return str(bare)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv that sees this interpreter's packages (sys.prefix's site-packages, through a
    .pth), runs the real ``libreyolo-agent``, and whose ``libreyolo`` is the scripted trainer
    held at its first epoch."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]  # this interpreter's: sys.prefix's site-packages
    Path(purelib, "zz_test_bootstrap.pth").write_text(
        f"import site; site.addsitedir({ours!r})\n", encoding="utf-8"
    )
    agent = root / "bin" / "libreyolo-agent"
    agent.write_text(
        f"#!{python}\nimport sys\nfrom agent.cli import main\nsys.exit(main())\n", encoding="utf-8"
    )
    trainer = root / "bin" / "libreyolo"
    trainer.write_text(
        "#!/bin/sh\n"
        "# `libreyolo train ARGS`: the scripted trainer, waiting at the start of epoch 1\n"
        '[ "$1" = train ] && shift\n'
        f'exec "{python}" "{TRAINER}" "$@" pause_at=1\n',
        encoding="utf-8",
    )
    for exe in (agent, trainer):
        exe.chmod(0o755)
    return root


JOB = """[job]
name = "boot"
runs_dir = "{root}/runs"
[train]
model = "yolox-n"
pretrained = false
data = "{root}/data.yaml"
epochs = 3
imgsz = 64
batch = 4
workers = 0
device = "cpu"
[dataset]
doctor = false
[preflight]
enabled = false
[server]
listen = "127.0.0.1:0"
[teardown]
provider = "none"
"""


class Box:
    """A box's folders under ``root`` and the environment its start hook runs with."""

    def __init__(self, root: Path, venv: Path, repo_url: str) -> None:
        self.root = root
        self.opt = root / "opt" / "libreyolo-agent"
        self.etc = root / "etc"
        self.state = root / "state"
        self.mark = uuid.uuid4().hex
        (root / "opt").mkdir(parents=True)
        (root / "volume").mkdir()
        (root / "data.yaml").write_text("path: .\ntrain: images\nval: images\nnames: [a]\n")
        job = root / "given-job.toml"
        job.write_text(JOB.format(root=root), encoding="utf-8")
        self.etc.mkdir()
        # The files Lambda's and AWS's runcmd source (written by cloud-init and by you).
        (self.etc / "agent.env").write_text(
            f"LIBREYOLO_AGENT_REPO={repo_url}\nLIBREYOLO_AGENT_JOB={job}\n", encoding="utf-8"
        )
        (self.etc / "secrets.env").write_text(f"HF_TOKEN={TOKEN}\n", encoding="utf-8")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("LIBREYOLO_AGENT_", "HF_", "VAST", "RUNPOD", "CONTAINER_"))
        }
        env.update(
            {
                MARK: self.mark,
                "LIBREYOLO_AGENT_REPO": repo_url,
                "LIBREYOLO_AGENT_JOB": str(job),
                "LIBREYOLO_AGENT_CONFIG_DIR": str(self.etc),
                "LIBREYOLO_AGENT_STATE_DIR": str(self.state),
                "LIBREYOLO_AGENT_VOLUME": str(root / "volume"),
                "LIBREYOLO_AGENT_SYSTEMD_DIR": str(root / "units"),
                "LIBREYOLO_AGENT_INIT": "container",
                "VENV": str(venv),
                "HF_TOKEN": TOKEN,
            }
        )
        self.env = env

    def localize(self, stmt: str) -> str:
        """The statement with this box's folders, and ``--no-install`` (the venv is ready)."""
        for path, local in zip(BOX_PATHS, (self.opt, self.etc, self.state), strict=True):
            stmt = stmt.replace(path, str(local))
        new, n = re.subn(r'(scripts/bootstrap\.sh"?)', r"\1 --no-install", stmt)
        assert n == 1, stmt
        return new

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", script],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    def supervisor_pid(self) -> int | None:
        try:
            text = (self.state / "supervisor.pid").read_text()
        except OSError:
            return None
        digits = re.findall(r"\d+", text)
        return int(digits[0]) if digits else None

    def marked(self) -> list[psutil.Process]:
        """Every live process started with this box's marker in its environment."""
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get(MARK) == self.mark and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        return found

    def kill_all(self) -> None:
        """SIGKILL every process of this box until none is left (a supervisor could start an
        agent between two passes)."""
        for _ in range(50):
            procs = self.marked()
            if not procs:
                return
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGKILL)
            psutil.wait_procs(procs, timeout=10)
        raise AssertionError(f"processes of the test box survive: {self.marked()}")


@pytest.fixture
def box(tmp_path: Path, venv: Path, repo_url: str) -> Iterator[Box]:
    made = Box(tmp_path / "box", venv, repo_url)
    try:
        yield made
    finally:
        made.kill_all()


def wait_until(pred: Callable[[], Any], timeout: float = 180.0, what: str = "") -> Any:
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"not reached in time: {what}")
        time.sleep(0.1)


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def waiting_trainer(box: Box) -> bool:
    return any((box.root / "runs").glob("boot*/.paused"))


# ------------------------------------------------------------------ every start line, twice


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stmt", sorted(START_LINES), ids=lambda s: f"{len(s)}-chars")
def test_a_start_line_run_twice_starts_one_agent_and_restarts_a_dead_one(
    stmt: str, box: Box
) -> None:
    where = START_LINES[stmt]
    script = box.localize(stmt)
    # A clone cut off half-way by an earlier boot (power loss during the first start).
    half = box.opt.parent / (box.opt.name + ".part")
    (half / ".git").mkdir(parents=True)
    (half / ".git" / "HEAD").write_text("garbage")

    first = box.run(script)
    out1 = first.stdout + first.stderr
    assert first.returncode == 0, f"{where}\n{script}\n{out1}"
    assert (box.opt / ".git").is_dir() and (box.opt / "scripts" / "bootstrap.sh").is_file()
    assert not half.exists()
    assert "started the supervisor" in first.stdout, out1
    pid = wait_until(lambda: alive(box.supervisor_pid()) and box.supervisor_pid(), what="pid")
    wait_until(lambda: waiting_trainer(box), what="the agent's trainer, waiting at epoch 1")
    head = (box.opt / ".git" / "HEAD").read_text()

    # The second boot: nothing changes, the running supervisor is left alone.
    second = box.run(script)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, f"{where}\n{script}\n{out2}"
    assert f"the supervisor runs already (pid {pid})" in second.stdout, out2
    assert "started the supervisor" not in out2
    assert "unchanged:" in second.stdout and "Cloning into" not in out2
    assert (box.opt / ".git" / "HEAD").read_text() == head
    assert box.supervisor_pid() == pid and alive(pid)
    supervisors = [p for p in box.marked() if "supervise" in " ".join(p.cmdline())]
    assert [p.pid for p in supervisors] == [pid]

    # The box restarts (everything it ran is gone, the disk stays): the line starts it again.
    box.kill_all()
    third = box.run(script)
    out3 = third.stdout + third.stderr
    assert third.returncode == 0, f"{where}\n{script}\n{out3}"
    assert "started the supervisor" in third.stdout, out3
    new = wait_until(
        lambda: (p := box.supervisor_pid()) != pid and alive(p) and p, what="a new supervisor"
    )
    assert new != pid
    assert TOKEN not in out1 + out2 + out3


# ------------------------------------------------------------------ bootstrap.sh itself


def bootstrap(box: Box, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(BOOTSTRAP), "--no-install", *args],
        cwd=box.root,
        env=dict(box.env, **env),
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_closing_hint_names_a_state_dir_that_is_not_the_default(box: Box) -> None:
    proc = bootstrap(box)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (hint,) = [line for line in proc.stdout.splitlines() if "status --watch" in line]
    assert f"--state-dir {box.state}" in hint
    wait_until(lambda: waiting_trainer(box), what="the trainer")
    # The hint, as printed, from a shell that knows nothing of LIBREYOLO_AGENT_STATE_DIR.
    command = hint.split("on the box:", 1)[1].replace("--watch", "").strip()
    env = {k: v for k, v in box.env.items() if k != "LIBREYOLO_AGENT_STATE_DIR"}
    status = subprocess.run(
        ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert "TRAINING" in status.stdout or "training" in status.stdout.lower(), status.stdout
    # Where the token is, and the commands that print it (issue 28), as printed.
    assert f"{box.state}/token" in proc.stdout
    (token_hint,) = [
        line
        for line in proc.stdout.splitlines()
        if line.endswith(" token" + (f" --state-dir {box.state}"))
    ]
    command = token_hint.split("print it with:", 1)[1].strip()
    token = subprocess.run(
        ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120
    )
    assert token.returncode == 0, token.stderr
    assert token.stdout.strip() == (box.state / "token").read_text().strip()
    (login,) = [line for line in proc.stdout.splitlines() if "token --login-url" in line]
    url = subprocess.run(
        ["bash", "-c", login.strip()], env=env, capture_output=True, text=True, timeout=120
    )
    assert url.stdout.startswith("http://localhost:") and "/#token=" in url.stdout, url.stderr


def test_the_closing_hint_has_no_state_dir_option_for_the_default() -> None:
    # The default: the hint is the bare command. (Read from the script: a real run with the
    # default state dir would write to /var/lib.)
    text = BOOTSTRAP.read_text(encoding="utf-8")
    assert 'unit_state="/var/lib/libreyolo-agent"' in text
    assert re.search(r'if \[ "\$state_dir" != "\$unit_state" \]; then\n\s+state_opt=', text)


def test_help_names_every_variable_the_script_reads_and_the_repo() -> None:
    proc = subprocess.run(
        ["bash", str(BOOTSTRAP), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    text = BOOTSTRAP.read_text(encoding="utf-8")
    body = text.split("\nset -euo pipefail", 1)[1]
    read = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", body))
    read |= {n for group in re.findall(r"env_names=\(([^)]*)\)", body) for n in group.split()}
    read -= {"BASH_SOURCE"}  # bash's own
    assert "LIBREYOLO_AGENT_VOLUME" in read and "VENV" in read  # the scan sees the script
    for name in sorted(read | {"LIBREYOLO_AGENT_REPO"}):
        assert re.search(rf"\b{name}\b", proc.stdout), f"--help does not mention {name}"
    # How the recipes use LIBREYOLO_AGENT_REPO: the clone in the start line.
    assert 'git clone "$LIBREYOLO_AGENT_REPO"' in proc.stdout


def test_an_invalid_job_is_reported_and_the_agent_started_to_decide(box: Box) -> None:
    bad = "[job]\nname = 'x'\n[train]\nepochs = 'many'\n"
    proc = bootstrap(box, LIBREYOLO_AGENT_JOB_TOML=bad)
    out = proc.stdout + proc.stderr
    # bootstrap's own behaviour: the check's errors, loudly, and the supervisor started anyway.
    assert proc.returncode == 3, out
    assert "epochs" in proc.stderr  # the check's own error line
    assert "THE JOB FILE IS NOT VALID" in proc.stderr
    assert "failure decision" in proc.stderr
    started = re.search(r"started the supervisor \(pid (\d+)\)", proc.stdout)
    assert started is not None, out
    # It really ran `libreyolo-agent supervise JOB`: its output is in the supervisor's log (what
    # it does with the invalid job is the agent's own business, tested with the agent).
    log = box.state / "supervisor.out"
    wait_until(lambda: log.exists() and log.stat().st_size > 0, what="the supervisor's output")


def test_a_job_install_sh_cannot_read_installs_without_its_extras(box: Box) -> None:
    # install.sh --job exits 2 when the job's TOML cannot be read for its extras
    # (`python -m agent.install.torchpick extras JOB || exit 2`): bootstrap installs without them
    # and goes on to the check and the supervised agent, instead of dying before it.
    broken = "[train\nepochs = 1\n"
    job = box.root / "broken.toml"
    job.write_text(broken, encoding="utf-8")
    real = subprocess.run(
        [sys.executable, "-m", "agent.install.torchpick", "extras", str(job)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert real.returncode == 2, real.stdout + real.stderr
    repo = box.root / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(BOOTSTRAP, repo / "scripts" / "bootstrap.sh")
    calls = box.root / "install.calls"
    (repo / "install.sh").write_text(
        "#!/bin/bash\n"
        f'echo "$*" >>"{calls}"\n'
        'if [ "$1" = --job ]; then\n'
        f'  cd "{ROOT}" && "{sys.executable}" -m agent.install.torchpick extras "$2" '
        ">/dev/null || exit 2\n"
        "fi\n",
        encoding="utf-8",
    )
    (repo / "install.sh").chmod(0o755)
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "bootstrap.sh"), "--job", str(job)],
        cwd=box.root,
        env=box.env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert calls.read_text().splitlines() == [f"--job {box.etc / 'job.toml'}", ""]
    assert "installing without them" in proc.stdout
    assert "THE JOB FILE IS NOT VALID" in proc.stderr
    assert "started the supervisor" in proc.stdout
