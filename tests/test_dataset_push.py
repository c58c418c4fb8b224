"""``libreyolo-agent dataset push`` (agent/data/pack.py, push.py, pushcli.py; issue 29 item 5).

The tar is checked as the box's own unpacker checks it and unpacked by it (round trip); the
upload goes through the real ``huggingface_hub`` client to ``tests/fakes/hub.py`` on 127.0.0.1;
the end-to-end test pushes, pastes the printed ``[dataset]`` lines into a job file, runs the
real ``libreyolo-agent check`` on it, and stages the dataset with the agent's staging code. The
doctor tests run the real ``libreyolo doctor`` (torch's start-up: marked ``training``).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from agent.config.jobfile import parse_job
from agent.data import push as push_module
from agent.data.archive import safe_unpack
from agent.data.dataset import stage_dataset
from agent.data.pack import PackError, survey, write_tar
from agent.data.push import PushError, PushResult, push
from tests.fakes.hub import FakeHub
from tests.test_archive import write
from tests.test_cli import PREFIX
from tests.test_dataset import READ_TOKEN, WRITE_TOKEN, env_for, requires_libreyolo, yolo_dataset
from tests.test_dataset import hub as hub  # the fixture, used by name

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_libreyolo_datasets_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LibreYOLO looks in ~/datasets first: point it at a folder of the test's own (absent)."""
    monkeypatch.setenv("LIBREYOLO_DATASETS_DIR", str(tmp_path / "libreyolo-datasets"))


def tree(root: Path) -> dict[str, bytes | str]:
    """Every file (its bytes) and symlink (``-> target``) below ``root``, by relative path."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = f"-> {os.readlink(p)}"
        elif p.is_file():
            out[rel] = p.read_bytes()
    return out


def pushed(hub: FakeHub, tmp_path: Path, folder: Path, **kw: object) -> PushResult:
    return push(folder, "org/ds", env_for(hub.url, tmp_path, WRITE_TOKEN), doctor=False, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The tar


def test_the_tar_is_safe_deterministic_and_unpacks_with_the_agents_unpacker(
    tmp_path: Path,
) -> None:
    ds = yolo_dataset(tmp_path / "my-ds")
    (ds / "images" / "train" / "alias.png").symlink_to("im0.png")  # inside: kept, relative
    (ds / "empty").mkdir()
    os.chmod(ds / "labels" / "train" / "im0.txt", 0o600)
    seen: list[tuple[int, int]] = []

    first = write_tar(survey(ds), tmp_path / "a.tar", on_progress=lambda d, t: seen.append((d, t)))
    second = write_tar(survey(ds), tmp_path / "b.tar")

    assert first.sha256 == second.sha256 == hashlib.sha256(first.path.read_bytes()).hexdigest()
    assert seen[-1][0] == seen[-1][1] > 0 and [d for d, _ in seen] == sorted(d for d, _ in seen)
    with tarfile.open(first.path) as tf:
        members = tf.getmembers()
    names = [m.name for m in members]
    assert names[0] == "my-ds" and all(n.startswith("my-ds/") for n in names[1:])
    assert not any(n.startswith("/") or ".." in n.split("/") for n in names)
    assert {(m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, "", "")}
    assert {m.mode for m in members} <= {0o644, 0o755}
    (link,) = [m for m in members if m.issym()]
    assert (link.name, link.linkname) == ("my-ds/images/train/alias.png", "im0.png")

    safe_unpack(first.path, tmp_path / "out")  # what staging runs on the box
    assert tree(tmp_path / "out" / "my-ds") == tree(ds)
    assert (tmp_path / "out" / "my-ds" / "empty").is_dir()


def test_survey_names_everything_the_unpacker_refuses(tmp_path: Path) -> None:
    ds = yolo_dataset(tmp_path / "ds")
    write(tmp_path / "secret.txt", b"laptop only")
    (ds / "out.txt").symlink_to(tmp_path / "secret.txt")
    (ds / "gone.png").symlink_to(ds / "nothing.png")
    os.mkfifo(ds / "pipe")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(ds / "sock"))
        with pytest.raises(PackError) as caught:
            survey(ds)
    message = str(caught.value)
    assert "holds 4 thing(s) the box's unpacker refuses" in message, message
    assert "'out.txt' is a symlink that leads out of the folder" in message
    assert "'gone.png' is a broken symlink" in message
    assert "'pipe' is a FIFO" in message and "'sock' is a socket" in message
    assert message.endswith("push a copy made of plain files (cp -rL DIR COPY)")


def test_a_file_that_changed_after_the_listing_stops_the_pack(tmp_path: Path) -> None:
    ds = yolo_dataset(tmp_path / "ds")
    found = survey(ds)
    (ds / "labels" / "val" / "im1.txt").write_bytes(b"0 0.5 0.5 0.3 0.3\n" * 3)
    with pytest.raises(PackError, match=r"im1.txt changed while it was packed .*push again"):
        write_tar(found, tmp_path / "ds.tar")
    assert not (tmp_path / "ds.tar").exists() and not (tmp_path / ".ds.tar.partial").exists()


def test_packing_streams_the_files_through_a_small_buffer(tmp_path: Path) -> None:
    ds = yolo_dataset(tmp_path / "ds")
    with open(ds / "images" / "train" / "big.png", "wb") as f:
        f.truncate(64 << 20)  # sparse: cheap to make, 64 MiB to read
    found = survey(ds)
    tracemalloc.start()
    try:
        packed = write_tar(found, tmp_path / "ds.tar")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert packed.size > 64 << 20
    assert peak < 8 << 20, peak  # the chunk (1 MiB) and tarfile's buffers, not the file


# --------------------------------------------------------------------------------------------
# The push, through the real client to the fake Hub


def test_push_uploads_one_private_tar_reads_it_back_and_prints_the_job_lines(
    hub: FakeHub, tmp_path: Path
) -> None:
    ds = yolo_dataset(tmp_path / "my-ds")
    hub.clear_requests()
    result = pushed(hub, tmp_path, ds)

    assert hub.is_private("dataset", "org/ds") and result.private
    assert hub.file("dataset", "org/ds", "my-ds.tar") == (tmp_path / "my-ds.tar").read_bytes()
    assert result.commit == hub.head("dataset", "org/ds")
    assert result.sha256 == result.remote_sha256 == hub.describe(
        "dataset", "org/ds", "my-ds.tar"
    )["lfs"]["oid"]  # fmt: skip
    assert (result.images, result.files, result.doctor) == (6, 13, "off")
    assert [r.route for r in hub.requests].count("commit") == 1
    assert [r.route for r in hub.requests].count("lfs_upload") == 1

    job = parse_job(
        "[train]\nmodel = 'yolox-n'\nepochs = 1\n" + result.job_lines(),
        source="pasted",
        base_dir=tmp_path,
    )
    assert job.dataset is not None
    assert (job.dataset.repo, job.dataset.file, job.dataset.revision) == (
        "org/ds",
        "my-ds.tar",
        result.commit,
    )
    assert job.dataset.data_yaml == "my-ds/data.yaml"


def test_a_second_push_of_the_same_folder_sends_nothing(hub: FakeHub, tmp_path: Path) -> None:
    ds = yolo_dataset(tmp_path / "ds")
    first = pushed(hub, tmp_path, ds)
    hub.clear_requests()
    second = pushed(hub, tmp_path, ds)
    assert second.sha256 == first.sha256 and second.commit == first.commit and second.unchanged
    assert "lfs_upload" not in [r.route for r in hub.requests]
    assert len(hub.commits("dataset", "org/ds")) == 2  # the initial commit and the push


def test_an_existing_public_repo_is_kept_and_named_in_a_warning(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.add_repo("dataset", "org/ds", private=False)
    result = pushed(hub, tmp_path, yolo_dataset(tmp_path / "ds"))
    assert not result.private and not hub.is_private("dataset", "org/ds")
    assert any("org/ds is public" in w for w in result.warnings), result.warnings


def test_a_read_back_that_differs_fails_the_push(hub: FakeHub, tmp_path: Path) -> None:
    hub.lose("corrupt")  # the commit answers success; one byte of the stored file flipped
    with pytest.raises(PushError) as caught:
        pushed(hub, tmp_path, yolo_dataset(tmp_path / "ds"))
    assert caught.value.kind == "hub"
    assert "read-back of ds.tar from org/ds@" in str(caught.value)
    assert str(caught.value).endswith("push again")


@pytest.mark.parametrize(
    ("token", "fault", "says"),
    [
        ("hf_not_a_real_token_0123456789", None, "the Hub refused the token (HTTP 401"),
        (READ_TOKEN, None, "the token may not write there (HTTP 403"),
        (WRITE_TOKEN, "commit", "a transient error on the Hub (HTTP 503"),
    ],
)
def test_what_the_hub_refuses_is_one_line_with_the_fix(
    hub: FakeHub, tmp_path: Path, token: str, fault: str | None, says: str
) -> None:
    if fault is not None:
        hub.fail(fault, 503)
    if token == READ_TOKEN:
        hub.add_repo("dataset", "org/ds", private=True)
    with pytest.raises(PushError) as caught:
        push(
            yolo_dataset(tmp_path / "ds"), "org/ds", env_for(hub.url, tmp_path, token), doctor=False
        )
    message = str(caught.value)
    assert caught.value.kind == "hub" and says in message and "\n" not in message, message
    assert token not in message


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        ("missing", "does not exist; give the dataset's folder"),
        ("no_images", "holds no images (.bmp, "),
        ("no_yaml", "no data YAML with train and val keys found in"),
        ("absolute", "names absolute paths (path: /"),
        ("outside", "points outside the dataset folder"),
        ("bad_repo", "is not a Hub repo id: must be namespace/name"),
    ],
)
def test_mistakes_are_found_before_anything_goes_up(
    hub: FakeHub, tmp_path: Path, setup: str, says: str
) -> None:
    ds = yolo_dataset(tmp_path / "ds")
    repo = "org/ds"
    if setup == "missing":
        ds = tmp_path / "nope"
    elif setup == "no_images":
        for p in ds.glob("images/*/*"):
            p.unlink()
    elif setup == "no_yaml":
        (ds / "data.yaml").unlink()
    elif setup == "absolute":
        (ds / "data.yaml").write_text(f"path: {ds}\ntrain: images/train\nval: images/val\n")
    elif setup == "outside":
        yolo_dataset(tmp_path / "elsewhere")
        (ds / "data.yaml").write_text("train: ../elsewhere/images/train\nval: images/val\n")
    else:
        repo = "org/ds/extra"
    hub.clear_requests()
    with pytest.raises(PushError) as caught:
        push(ds, repo, env_for(hub.url, tmp_path, WRITE_TOKEN), doctor=False)
    assert caught.value.kind == "usage" and says in str(caught.value), str(caught.value)
    assert not hub.requests and not hub.has_repo("dataset", "org/ds")
    assert not (tmp_path / "ds.tar").exists()


def test_without_libreyolo_the_doctor_is_asked_for_or_switched_off(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(push_module, "find_libreyolo", lambda: None)
    ds = yolo_dataset(tmp_path / "ds")
    env = env_for(hub.url, tmp_path, WRITE_TOKEN)
    with pytest.raises(PushError, match=r"libreyolo is not installed here.*--no-doctor") as c:
        push(ds, "org/ds", env)
    assert c.value.kind == "usage" and not hub.has_repo("dataset", "org/ds")
    assert push(ds, "org/ds", env, doctor=False).doctor == "off"


# --------------------------------------------------------------------------------------------
# End to end: the command, the job file, the agent's check and staging


def run_cli(
    tmp_path: Path, *args: str, hub_url: str, token: str | None = WRITE_TOKEN, **extra: str
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_ENDPOINT": hub_url,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "LIBREYOLO_DATASETS_DIR": str(tmp_path / "libreyolo-datasets"),
        "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state"),
        **({"HF_TOKEN": token} if token else {}),
        **extra,
    }
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=600,
    )


def test_push_paste_check_and_stage_end_to_end(hub: FakeHub, tmp_path: Path) -> None:
    ds = yolo_dataset(tmp_path / "my-ds")
    proc = run_cli(tmp_path, "dataset", "push", str(ds), "org/ds", "--no-doctor", hub_url=hub.url)
    assert proc.returncode == 0, proc.stderr
    assert "packing: 100 %" in proc.stderr and WRITE_TOKEN not in proc.stdout + proc.stderr
    assert "verified: the Hub's sha256" in proc.stdout
    lines = proc.stdout.split("add to the job file:\n\n", 1)[1]
    assert lines.startswith('[dataset]\nrepo = "org/ds"\nfile = "my-ds.tar"\n'), lines

    job = tmp_path / "job.toml"
    job.write_text(
        f'[job]\nname = "e2e"\nruns_dir = "{tmp_path / "runs"}"\n'
        "[train]\nmodel = 'yolox-n'\nepochs = 1\nimgsz = 64\n"
        + lines.replace("[dataset]\n", f'[dataset]\ndest = "{tmp_path / "data"}"\ndoctor = false\n')
    )
    check = run_cli(tmp_path, "check", str(job), "--json", hub_url=hub.url)
    assert check.returncode == 0, check.stderr
    verdict = json.loads(check.stdout)
    (archive,) = [p for p in verdict["rent"]["parts"] if p["what"] == "dataset archive"]
    assert archive["bytes"] == (tmp_path / "my-ds.tar").stat().st_size  # from the Hub's listing
    assert "from the Hub's listing" in archive["basis"]

    parsed = parse_job(job.read_text(), source=str(job), base_dir=tmp_path)
    assert parsed.dataset is not None
    staged = stage_dataset(
        parsed.dataset, env_for(hub.url, tmp_path, READ_TOKEN), data_yaml=parsed.train.get("data")
    )
    assert staged.downloaded and staged.unpacked and staged.commit == parsed.dataset.revision
    assert staged.data_yaml == tmp_path / "data" / "my-ds" / "data.yaml"
    assert tree(tmp_path / "data" / "my-ds") == tree(ds)


def test_the_command_json_and_its_errors(hub: FakeHub, tmp_path: Path) -> None:
    ds = yolo_dataset(tmp_path / "ds")
    ok = run_cli(tmp_path, "dataset", "push", str(ds), "org/ds", "--no-doctor", "--json",
                 hub_url=hub.url)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] is True and doc["sha256"] == doc["remote_sha256"] and doc["private"]
    assert doc["job_lines"].startswith("[dataset]\n")

    no_token = run_cli(tmp_path, "dataset", "push", str(ds), "org/ds", "--no-doctor",
                       hub_url=hub.url, token=None)  # fmt: skip
    assert no_token.returncode == 2
    assert no_token.stderr.startswith(PREFIX + "no Hugging Face token: set HF_TOKEN")
    assert no_token.stderr.count("\n") == 1 and "Traceback" not in no_token.stderr

    bad = run_cli(tmp_path, "dataset", "push", str(ds), "org/ds", "--no-doctor", "--json",
                  hub_url=hub.url, token="hf_wrong_token_for_tests")  # fmt: skip
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    err = json.loads(bad.stdout)
    assert err["ok"] is False and err["exit_code"] == 1 and "refused the token" in err["error"]
    assert bad.stderr.endswith(PREFIX + err["error"] + "\n")
    assert "hf_wrong_token_for_tests" not in bad.stdout + bad.stderr

    missing = run_cli(tmp_path, "dataset", "push", str(tmp_path / "nope"), "org/ds",
                      hub_url=hub.url)  # fmt: skip
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr


def test_the_stored_login_is_used_when_hf_token_is_unset(hub: FakeHub, tmp_path: Path) -> None:
    write(tmp_path / "hf-home" / "token", WRITE_TOKEN.encode())  # what `hf auth login` stores
    ds = yolo_dataset(tmp_path / "ds")
    proc = run_cli(tmp_path, "dataset", "push", str(ds), "org/ds", "--no-doctor",
                   hub_url=hub.url, token=None)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert hub.file("dataset", "org/ds", "ds.tar") is not None


@requires_libreyolo
@pytest.mark.training
def test_the_doctor_passes_a_good_dataset_and_stops_a_broken_one(
    hub: FakeHub, tmp_path: Path
) -> None:
    good = run_cli(tmp_path, "dataset", "push", str(yolo_dataset(tmp_path / "good")), "org/good",
                   hub_url=hub.url)  # fmt: skip
    assert good.returncode == 0, good.stderr
    assert "doctor: passed" in good.stdout

    broken = yolo_dataset(tmp_path / "broken", broken=True)
    bad = run_cli(tmp_path, "dataset", "push", str(broken), "org/broken", hub_url=hub.url)
    assert bad.returncode == 2, bad.stderr
    last = bad.stderr.splitlines()[-1]  # after the step lines (check: ...)
    assert last.startswith(PREFIX + "libreyolo doctor found 1 error(s)"), bad.stderr
    assert "labels.syntax" in last
    assert "fix the dataset and push again" in bad.stderr and "Traceback" not in bad.stderr
    assert not hub.has_repo("dataset", "org/broken")


def test_other_commands_do_not_load_the_push_or_the_hub_client() -> None:
    """Every command builds the parser that holds ``dataset push``: building it must not
    import the Hub client (a box's ``run`` or a laptop's ``check`` would pay for it, and a
    broken huggingface_hub would break them all)."""
    code = (
        "import sys, agent.cli; agent.cli.build_parser(); "
        "print(sorted(m for m in ('agent.hub', 'agent.data.push', 'huggingface_hub') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
