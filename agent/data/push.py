"""``libreyolo-agent dataset push DIR org/name``: the guide's first step, done from the laptop.

"Pack it as a single tar in a Hugging Face dataset repo" is where a run is most often lost before
it starts: the tar holds the laptop's absolute paths or a symlink, the data YAML points at
``/home/me/...``, the repo is public, the upload broke half-way and nobody looked. :func:`push`
does the step the way the box will read it, and refuses early what the box would refuse late:

1. the folder: at least one image, a data YAML with ``train`` and ``val`` whose paths stay
   inside the folder and are not absolute (the box unpacks elsewhere), then ``libreyolo doctor``
   on it (LibreYOLO's own dataset check; the agent runs the same on the box); all local;
2. the Hub, before a long pack: a token (``HF_TOKEN``, else ``huggingface_hub``'s stored login),
   and the private dataset repo created (``exist_ok``: an existing one is kept as it is);
3. the tar (agent/data/pack.py), then the agent's own unpacker plans it (every member checked
   as a box will check it, nothing written): what push made, staging accepts;
4. one commit through the real ``huggingface_hub`` client (Git LFS, the client's progress bar),
   then the read-back: the Hub's sha256 of the file at that commit must equal the local one;
5. the ``[dataset]`` lines for the job file, pinned to that commit.

Every failure is a :class:`PushError`: one line with the fix, and whether it is the user's to
fix before pushing (``usage``: exit 2) or the Hub's answer (``hub``: exit 1). The token is never
printed: every message goes through :func:`agent.hub.redact`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent import hub
from agent.config.jobvalues import repo_id_problem
from agent.config.model import Env
from agent.data.archive import ArchiveError, disk_free, plan_unpack
from agent.data.datacheck import DoctorError, StagingError, check_data_yaml
from agent.data.dataset import find_data_yaml
from agent.data.pack import (
    IMAGE_SUFFIXES,
    Packed,
    PackError,
    PackProgress,
    Survey,
    survey,
    write_tar,
)
from agent.install.libreyolo import find_libreyolo
from agent.util.text import format_bytes, one_line, show

log = logging.getLogger(__name__)

#: Whose move a failed push is: the user's before pushing again (exit 2), or the Hub's (exit 1).
PushErrorKind = Literal["usage", "hub"]
#: What :func:`push` is doing, for a progress line: ``(step, detail)``.
StepHook = Callable[[str, str], None]
#: How long ``libreyolo doctor`` may take on a laptop (it imports torch, then reads every label).
DOCTOR_TIMEOUT_S = 1800.0
#: Where a fix for a missing or refused token is made.
TOKEN_FIX = (
    "set HF_TOKEN to a token with write access (huggingface.co/settings/tokens) or log in with "
    "`hf auth login`"
)


class PushError(Exception):
    """The push failed; the message is one line that names the fix."""

    def __init__(self, message: str, *, kind: PushErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PushResult:
    """What went up, and what the job file needs to stage it."""

    repo: str
    #: The archive's name in the repo, and the commit that holds it.
    file: str
    commit: str
    #: The local archive, its size and sha256; the Hub's sha256 of it (equal, or push raised).
    archive: Path
    archive_bytes: int
    sha256: str
    remote_sha256: str
    #: What the archive holds.
    files: int
    file_bytes: int
    images: int
    #: The data YAML's path inside the staged folder (``dataset.data_yaml``).
    data_yaml: str
    #: ``passed`` (``libreyolo doctor`` found no errors) or ``off`` (``--no-doctor``).
    doctor: Literal["passed", "off"]
    #: Whether the repo is private (False: it existed, public, before this push).
    private: bool
    #: The commit only pointed at an archive the repo already held (nothing new went up).
    unchanged: bool = False
    warnings: list[str] = field(default_factory=list)

    def job_lines(self) -> str:
        """The ``[dataset]`` table to paste into the job file (agent/config/jobfile.py reads it:
        ``repo``, ``file``, ``revision``, ``data_yaml``; ``dest`` keeps its default)."""
        return (
            "[dataset]\n"
            f'repo = "{self.repo}"\n'
            f'file = "{self.file}"\n'
            f'revision = "{self.commit}"   # the commit pushed; "main" follows later pushes\n'
            f'data_yaml = "{self.data_yaml}"\n'
        )

    def to_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["archive"] = str(self.archive)
        doc["job_lines"] = self.job_lines()
        return {"ok": True, **doc}


def push(
    directory: Path,
    repo: str,
    env: Env,
    *,
    tar: Path | None = None,
    data_yaml: str | None = None,
    doctor: bool = True,
    on_step: StepHook | None = None,
    on_pack: PackProgress | None = None,
) -> PushResult:
    """Check ``directory``, pack it to ``tar`` (default: ``NAME.tar`` beside it), upload it to
    the private dataset repo ``repo`` and read it back; see the module's docstring for the order.
    ``env`` gives the endpoint; its token, when unset, is the stored login's. ``data_yaml`` (a
    path inside ``directory``) picks the YAML when the folder holds several. Raises
    :class:`PushError`."""
    step = on_step or (lambda _step, _detail: None)
    root = Path(os.path.abspath(directory))
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise PushError(f"{root} {what}; give the dataset's folder", kind="usage")
    problem = repo_id_problem(repo)
    if problem:
        raise PushError(f"{show(repo)} is not a Hub repo id: {problem}", kind="usage")
    archive = Path(os.path.abspath(tar)) if tar is not None else root.parent / f"{root.name}.tar"
    if archive.suffix != ".tar":
        raise PushError(f"--tar {archive} must end in .tar (a plain tar)", kind="usage")
    token = env.hf_token or stored_token()
    if not token:
        raise PushError(f"no Hugging Face token: {TOKEN_FIX}", kind="usage")
    env = dataclasses.replace(env, hf_token=token)

    step("check", f"listing {root}")
    try:
        found = survey(root, skip=archive)
    except PackError as exc:
        raise PushError(str(exc), kind="usage") from None
    if found.images == 0:
        kinds = ", ".join(sorted(IMAGE_SUFFIXES))
        raise PushError(
            f"{root} holds no images ({kinds}); give the dataset's folder (images, labels and "
            "the data YAML)",
            kind="usage",
        )
    yaml_path, status, warnings = _check_data(found, data_yaml, doctor=doctor, step=step)
    _check_room(archive, found)

    api = _prepare_repo(env, repo, step)
    step("pack", f"{found.files} files, {format_bytes(found.file_bytes)} into {archive}")
    try:
        packed = write_tar(found, archive, on_progress=on_pack)
    except PackError as exc:
        raise PushError(str(exc), kind="usage") from None
    _check_unpacks(packed.path)

    file = archive.name
    step("upload", f"{file} ({format_bytes(packed.size)}) to {repo}")
    commit, unchanged = _upload(api, env, repo, file, packed)
    step("verify", f"reading {file} back from {repo}@{commit[:12]}")
    remote = _read_back(api, env, repo, file, commit)
    if remote != packed.sha256:
        raise PushError(
            f"read-back of {file} from {repo}@{commit}: the Hub holds sha256 {remote}, the "
            f"local archive is {packed.sha256}; push again",
            kind="hub",
        )
    private = _is_private(api, env, repo)
    if not private:
        warnings.append(
            f"{repo} is public (it existed before this push): anyone can download the dataset; "
            "make it private in its settings on the Hub"
        )
    return PushResult(
        repo=repo,
        file=file,
        commit=commit,
        archive=packed.path,
        archive_bytes=packed.size,
        sha256=packed.sha256,
        remote_sha256=remote,
        files=found.files,
        file_bytes=found.file_bytes,
        images=found.images,
        data_yaml=f"{found.top}/{yaml_path.relative_to(root).as_posix()}",
        doctor=status,
        private=private,
        unchanged=unchanged,
        warnings=warnings,
    )


def stored_token() -> str | None:
    """The token ``huggingface_hub`` would use on this laptop: ``HF_TOKEN``, else the one
    ``hf auth login`` stored (the agent on a box never reads a stored one: agent/hub.py)."""
    hub.load()
    from huggingface_hub import get_token

    try:
        return get_token()
    except (OSError, ValueError, RuntimeError):
        return None


# --------------------------------------------------------------------------------------------
# The folder


def _check_data(
    found: Survey, data_yaml: str | None, *, doctor: bool, step: StepHook
) -> tuple[Path, Literal["passed", "off"], list[str]]:
    """The data YAML as staging will check it on the box, then ``libreyolo doctor``."""
    root = found.root
    if data_yaml is not None and (
        os.path.isabs(data_yaml) or ".." in data_yaml.replace("\\", "/").split("/")
    ):
        raise PushError(f"--data-yaml {show(data_yaml)} must be a path inside {root}", kind="usage")
    try:
        path = find_data_yaml(root, data_yaml, required=True)
    except StagingError as exc:
        # Staging's words name dataset.data_yaml; here the choice is --data-yaml.
        text = str(exc).replace("set dataset.data_yaml to", "pass --data-yaml with")
        text = text.replace("; set dataset.data_yaml", "; add LibreYOLO's data.yaml")
        raise PushError(text.replace("dataset.data_yaml", "--data-yaml"), kind="usage") from None
    assert path is not None  # required=True
    _refuse_absolute_paths(path)
    if doctor and find_libreyolo() is None:
        raise PushError(
            "libreyolo is not installed here, so its doctor cannot check the dataset before it "
            "goes up: pip install libreyolo, or pass --no-doctor to push without it",
            kind="usage",
        )
    step("check", f"libreyolo doctor on {path}" if doctor else f"{path} (doctor off)")
    try:
        checked = check_data_yaml(
            path,
            doctor=doctor,
            allow_outside_paths=False,
            staged_root=root,
            timeout_s=DOCTOR_TIMEOUT_S,
        )
    except DoctorError as exc:
        raise PushError(_doctor_message(path, exc.report), kind="usage") from None
    except StagingError as exc:
        text = str(exc).replace("staged dataset", "dataset folder")
        text = text.replace(", or set dataset.allow_outside_paths = true to allow it", "")
        raise PushError(text, kind="usage") from None
    return path, "passed" if doctor else "off", list(checked.warnings)


def _refuse_absolute_paths(path: Path) -> None:
    """A data YAML naming this laptop's absolute paths fails on the box, which unpacks it
    elsewhere: refused here, with the relative form."""
    import yaml  # type: ignore[import-untyped,unused-ignore]

    try:
        config = yaml.safe_load(path.read_bytes())
    except (OSError, yaml.YAMLError):
        return  # check_data_yaml says what is wrong with it
    if not isinstance(config, dict):
        return
    named = [("path", config.get("path"))]
    for key in ("train", "val", "test"):
        value = config.get(key)
        items = value if isinstance(value, list) else [value]
        named += [(key, v) for v in items]
    absolute = [f"{k}: {v}" for k, v in named if isinstance(v, str) and os.path.isabs(v)]
    if absolute:
        raise PushError(
            f"the data YAML {path} names absolute paths ({'; '.join(absolute[:3])}), which do "
            "not exist on the box; make them relative to the YAML's folder (remove path:, or "
            "path: ., and train: images/train)",
            kind="usage",
        )


def _doctor_message(path: Path, report: dict[str, Any]) -> str:
    findings = [f for f in report.get("findings") or [] if isinstance(f, dict)]
    bad = [f for f in findings if f.get("severity") == "error"]
    shown = " | ".join(
        f"{f.get('check_id', '?')}: {one_line(str(f.get('message', '')), 120)}" for f in bad[:3]
    )
    more = f" | and {len(bad) - 3} more" if len(bad) > 3 else ""
    shown = shown or "see its report"
    return (
        f"libreyolo doctor found {len(bad) or 'some'} error(s) in {path}: {shown}{more}; fix "
        f"the dataset and push again (libreyolo doctor data={path} shows them all), or pass "
        "--no-doctor to push it anyway"
    )


def _check_room(archive: Path, found: Survey) -> None:
    """The archive needs the files' bytes plus a 512-byte header (and padding) per member."""
    need = found.file_bytes + 1024 * len(found.members) + (1 << 20)
    try:
        free = disk_free(archive.parent)
    except OSError as exc:
        raise PushError(
            f"cannot write the archive in {archive.parent} ({exc.strerror or exc}); pass --tar "
            "PATH somewhere writable",
            kind="usage",
        ) from None
    if free < need:
        raise PushError(
            f"{archive.parent} has {format_bytes(free)} free, the archive needs about "
            f"{format_bytes(need)}; pass --tar PATH on a disk with room",
            kind="usage",
        )


def _check_unpacks(archive: Path) -> None:
    """The agent's own unpacker plans the archive as a box will (nothing is written)."""
    scratch = Path(tempfile.gettempdir()) / "libreyolo-agent-push-check"
    try:
        plan_unpack(archive, scratch)
    except ArchiveError as exc:
        raise PushError(
            f"the box's unpacker would refuse {archive.name}: {exc}", kind="usage"
        ) from None


# --------------------------------------------------------------------------------------------
# The Hub


def _prepare_repo(env: Env, repo: str, step: StepHook) -> Any:
    """The client, and the private dataset repo (kept as it is when it exists)."""
    hub.configure(env)
    api = hub.api(env)
    step("repo", f"private dataset repo {repo} on {env.hf_endpoint}")
    try:
        api.create_repo(repo, repo_type="dataset", private=True, exist_ok=True)
    except ValueError as exc:
        if not _refused_create_of_existing(exc):
            raise _hub_error(env, f"creating {repo}", exc) from None
    except hub.CALL_ERRORS as exc:
        raise _hub_error(env, f"creating {repo}", exc) from None
    return api


def _refused_create_of_existing(exc: ValueError) -> bool:
    """``create_repo(exist_ok=True)`` with a token that may not create found the repo, then
    failed only in building its URL for another endpoint than the import-time one (see
    agent/sinks/hf.py). The repo exists; whether the token may write shows at the upload."""
    seen: BaseException | None = exc.__context__
    while seen is not None:
        status = hub.http_status(seen)
        if status is not None:
            return status in (401, 402, 403)
        seen = seen.__context__
    return False


def _upload(api: Any, env: Env, repo: str, file: str, packed: Packed) -> tuple[str, bool]:
    """One commit adding ``file``; ``(its commit, whether the repo already held these bytes)``."""
    from huggingface_hub import CommitOperationAdd

    try:
        op = CommitOperationAdd(path_in_repo=file, path_or_fileobj=str(packed.path))
        if not getattr(op.upload_info, "is_hashed", True):
            # Computed while packing: the client need not read a multi-GB tar once more.
            op.upload_info.sha256 = bytes.fromhex(packed.sha256)
        before = _head(api, repo)
        info = api.create_commit(
            repo,
            operations=[op],
            commit_message=f"libreyolo-agent dataset push: {file}",
            repo_type="dataset",
        )
    except hub.CALL_ERRORS as exc:
        raise _hub_error(env, f"upload of {file} to {repo}", exc) from None
    commit = str(info.oid)
    return commit, commit == before


def _head(api: Any, repo: str) -> str | None:
    try:
        return str(api.repo_info(repo, repo_type="dataset").sha)
    except hub.CALL_ERRORS:
        return None  # the upload says what is wrong


def _read_back(api: Any, env: Env, repo: str, file: str, commit: str) -> str:
    """The Hub's sha256 of ``file`` at ``commit``: the LFS oid it computed on receipt, or, for
    a file it keeps in git (small), the sha256 of a download."""
    from huggingface_hub import RepoFile

    try:
        infos = api.get_paths_info(repo, [file], revision=commit, repo_type="dataset")
        entry = next((i for i in infos if isinstance(i, RepoFile) and i.path == file), None)
        if entry is None:
            raise PushError(
                f"read-back of {file} from {repo}@{commit}: the Hub does not list it; push again",
                kind="hub",
            )
        if entry.lfs is not None:
            return str(entry.lfs.sha256)
        with tempfile.TemporaryDirectory(prefix="libreyolo-agent-push-") as scratch:
            got = api.hf_hub_download(
                repo, file, repo_type="dataset", revision=commit, local_dir=scratch
            )
            digest = hashlib.sha256()
            with open(got, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
            return digest.hexdigest()
    except hub.CALL_ERRORS as exc:
        raise _hub_error(env, f"read-back of {file} from {repo}", exc) from None


def _is_private(api: Any, env: Env, repo: str) -> bool:
    try:
        return bool(api.repo_info(repo, repo_type="dataset").private)
    except hub.CALL_ERRORS as exc:
        raise _hub_error(env, f"reading {repo}'s settings", exc) from None


def _hub_error(env: Env, action: str, exc: BaseException) -> PushError:
    """One line with the fix; never the token."""
    failure = hub.classify(exc, token=env.hf_token)
    detail = failure.detail
    match failure.kind:
        case "unauthorized":
            msg = f"the Hub refused the token ({detail}); {TOKEN_FIX}"
        case "forbidden" | "gated":
            msg = (
                f"the token may not write there ({detail}); use a token with write access to "
                "that namespace (HF_TOKEN, or `hf auth login`)"
            )
        case "missing_repo":
            msg = f"the repo was not found or the token cannot see it ({detail}); {TOKEN_FIX}"
        case "rate_limited":
            wait = failure.retry_after_s
            hint = f" in {wait:g} s" if wait is not None else " later"
            msg = f"rate limited by the Hub ({detail}); push again{hint}"
        case "transient":
            msg = f"a transient error on the Hub ({detail}); push again"
        case "unreachable":
            msg = f"cannot reach {env.hf_endpoint} ({detail}); check the network and HF_ENDPOINT"
        case "offline":
            msg = f"HF_HUB_OFFLINE is set ({detail}); unset it to push"
        case "not_a_hub":
            msg = f"{env.hf_endpoint} does not answer like the Hub ({detail}); check HF_ENDPOINT"
        case "local":
            msg = f"this machine failed ({detail})"
        case _:
            msg = f"the Hub refused it ({detail})"
    return PushError(hub.redact(f"{action} failed: {msg}", env.hf_token), kind="hub")
