"""The job file (TOML) and the environment, validated once into frozen dataclasses.

Every error names the key, the value and what was expected, so that ``libreyolo-agent check``
can print one line and exit 2. Unknown keys are errors: a typo must never be silently ignored
on a box that bills by the hour.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import re
import sys
import tomllib
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .trainargs import TrainOptions, installed_train_options

#: Default state directory (env ``LIBREYOLO_AGENT_STATE_DIR`` overrides it).
DEFAULT_STATE_DIR = Path("/var/lib/libreyolo-agent")
#: Default HTTP listen address; 8420 is taken by ``libreyolo monitor``.
DEFAULT_LISTEN = "127.0.0.1:8421"
DEFAULT_HF_ENDPOINT = "https://huggingface.co"

#: ``[train]`` keys whose relative values name files beside the job file.
_PATH_TRAIN_KEYS = frozenset({"data", "model"})
#: ``[train]`` keys the agent sets itself; a job may not set them.
RESERVED_TRAIN_KEYS = frozenset({"project", "name", "json"})

TrainValue = str | int | float | bool


class ConfigError(Exception):
    """A job file or environment value is wrong. The message names the key and the fix.

    The message is always one printable line: a key or value holding a newline, a NUL or an
    escape sequence is shown escaped, so ``check`` prints one line and a terminal stays sane."""

    def __init__(self, key: str, message: str) -> None:
        self.key = _printable(key if len(key) <= 200 else key[:197] + "...")
        super().__init__(_printable(f"{self.key}: {message}"))


# --------------------------------------------------------------------------------------------
# Durations

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(d|h|m|s)")
_DURATION_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(key: str, value: object) -> float:
    """Parse ``"12h"``, ``"20m"``, ``"1h30m"``, ``"45s"``, ``"2d"`` or a number of seconds."""
    expected = 'a duration like "90s", "20m", "12h", "1h30m", "2d" or a number of seconds'
    if isinstance(value, bool):
        raise ConfigError(key, f"{value!r} is not {expected}")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            raise ConfigError(key, f"{_show(value)} is too large for {expected}") from None
    elif isinstance(value, str):
        text = value.strip().lower()
        pos = 0
        seconds = 0.0
        for m in _DURATION_PART.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
        if not text or pos != len(text):
            raise ConfigError(key, f"{value!r} is not {expected}")
    else:
        raise ConfigError(key, f"{value!r} is not {expected}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(key, f"{value!r} must be a positive duration ({expected})")
    return seconds


def format_duration(seconds: float) -> str:
    """``5400 -> "1h30m"``; used in messages and ``/status``."""
    s = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            parts.append(f"{s // size}{unit}")
            s %= size
    if s or not parts:
        parts.append(f"{s}s")
    return "".join(parts)


# --------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class JobSection:
    #: Run name, passed to LibreYOLO as ``name=`` (LibreYOLO may suffix it: ``run1`` -> ``run12``).
    name: str = "run1"
    #: Directory that holds run directories, passed as ``project=``.
    runs_dir: Path = Path("runs")
    #: Stop the trainer when the agent itself is stopped (SIGINT/SIGTERM). Default False: the
    #: trainer outlives the agent, and a restarted agent re-attaches to it.
    stop_trainer_on_exit: bool = False


@dataclass(frozen=True)
class TrainSection:
    #: ``key=value`` arguments for ``libreyolo train`` in job-file order (``data`` is required).
    args: tuple[tuple[str, TrainValue], ...] = ()
    #: Seconds to wait after SIGINT (LibreYOLO's clean stop) before SIGTERM, then before SIGKILL.
    stop_grace_s: float = 60.0
    kill_grace_s: float = 10.0

    def get(self, key: str, default: TrainValue | None = None) -> TrainValue | None:
        for k, v in self.args:
            if k == key:
                return v
        return default

    @property
    def epochs(self) -> int | None:
        value = self.get("epochs")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class DatasetSection:
    """A dataset staged from the Hub: present only when ``[dataset]`` names a ``repo`` and a
    ``file``. What is checked in every job's data YAML is :class:`DataCheckSection`."""

    #: Hugging Face dataset repo (``org/name``, the Hub's repo id rules) holding one archive.
    repo: str
    #: Archive file name inside the repo (.tar, .tar.gz/.tgz, .tar.bz2, .tar.xz, .zip).
    file: str
    #: Branch, tag or commit to download.
    revision: str = "main"
    #: Directory the archive is unpacked into.
    dest: Path = Path("data")
    #: Run ``libreyolo doctor`` while staging. The job file's ``dataset.doctor`` (default true)
    #: fills it with the same value as ``Job.data_check.doctor``; built in code it stays off.
    #: Transitional: the doctor belongs to every job's data YAML (``Job.data_check``).
    doctor: bool = False
    #: Path of the data YAML inside ``dest``; used as ``train.data`` when that is not set.
    data_yaml: str | None = None


@dataclass(frozen=True)
class DataCheckSection:
    """Checks of the data YAML the trainer gets, staged or local (the ``[dataset]`` table's
    ``doctor`` and ``allow_outside_paths``; a ``[dataset]`` table may hold only these two)."""

    #: Run ``libreyolo doctor`` on the job's data YAML before the trainer starts; its errors
    #: stop the job before any GPU time is spent. Default true; ``dataset.doctor = false``
    #: opts out.
    doctor: bool = True
    #: Let the staged data YAML's ``path:``, ``train:``, ``val:`` (and ``test:``) point outside
    #: the staged folder (``dataset.dest``). Default false: a downloaded dataset cannot make the
    #: trainer read, or LibreYOLO write caches into, other folders of the box.
    allow_outside_paths: bool = False


@dataclass(frozen=True)
class SyncSection:
    #: ``file:///abs/dir`` or ``hf://org/repo`` (a model repo, created private if missing).
    target: str
    #: Upload ``last.pt`` every N completed epochs (``best.pt`` goes up on each new best,
    #: ``epoch_N.pt`` snapshots always, and everything at the end).
    every_epochs: int = 1
    #: Create the Hub repo private when it does not exist yet.
    private: bool = True
    #: Seconds one upload may take before it is abandoned and retried.
    upload_timeout_s: float = 600.0
    #: Longest pause between retries of a failing upload (exponential backoff with jitter).
    max_backoff_s: float = 300.0
    #: How long FINISHING waits for the final sync before verifying what made it, seconds.
    finish_timeout_s: float = 1800.0

    @property
    def scheme(self) -> str:
        return urlsplit(self.target).scheme

    @property
    def location(self) -> str:
        """The folder (``file://``) or ``org/repo`` (``hf://``) of the target."""
        parsed = urlsplit(self.target)
        if parsed.scheme == "file":
            return parsed.path
        return (parsed.netloc + parsed.path).strip("/")


@dataclass(frozen=True)
class LimitsSection:
    #: Wall-clock limit of the training phase, seconds.
    max_runtime_s: float | None = None
    #: Training counts as stalled when status.json has not moved on for this long, seconds.
    stall_timeout_s: float | None = None
    #: Stop the job once the box has cost this much (USD); needs ``price_usd_per_hour`` > 0.
    budget_usd: float | None = None
    #: What the box costs per hour (USD), for the budget and the cost figures; >= 0.
    price_usd_per_hour: float | None = None


@dataclass(frozen=True)
class TeardownSection:
    #: ``none`` only records what it would do. Cloud providers land in their own issue.
    provider: str = "none"
    #: What to do with the box when training completed: ``destroy``, ``stop`` or ``keep``.
    on_success: str = "destroy"
    #: What to do after any other outcome (the box holds checkpoints: keep its disk).
    on_failure: str = "stop"
    #: What to do when preflight (or staging) failed: nothing was trained, the box is bad.
    on_preflight_failure: str = "destroy"
    #: Never destroy or stop the box unless every checkpoint upload was verified.
    require_verified_sync: bool = True


@dataclass(frozen=True)
class ServerSection:
    """The HTTP endpoint (``[server] listen = "host:port"``)."""

    #: Address to bind: an IP address (IPv6 without brackets here) or ``localhost``.
    host: str = "127.0.0.1"
    #: TCP port; 0 picks a free one (tests); the bound port is written to state.json.
    port: int = 8421
    #: ``[server] allow_remote``: permit a ``host`` that is not loopback (``0.0.0.0``, ``[::]``,
    #: a LAN address). Default false. Anyone who can reach that address can read ``/status``
    #: (job, progress, paths, sync target); the POST routes still need the token. Prefer an SSH
    #: tunnel to 127.0.0.1.
    allow_remote: bool = False

    @property
    def loopback(self) -> bool:
        """True when ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
        return _is_loopback(self.host)


@dataclass(frozen=True)
class PreflightSection:
    #: Run the checks before staging. Turning them off is for debugging only.
    enabled: bool = True
    #: Missing CUDA is a warning rather than a failure (the demo job allows CPU).
    allow_cpu: bool = False
    #: Seconds the torch probe may take before the GPU counts as hung.
    timeout_s: float = 120.0
    #: Also import LibreYOLO's model classes (which import torchvision): catches a torchvision
    #: built for another torch before training starts, but costs about 5 s on an H200 box.
    #: Off, that mismatch still fails the first training launch at once, with LibreYOLO's message.
    deep_import: bool = False


@dataclass(frozen=True)
class Env:
    """What the agent reads from the environment. Secrets never appear in ``repr``."""

    state_dir: Path = DEFAULT_STATE_DIR
    hf_endpoint: str = DEFAULT_HF_ENDPOINT
    hf_home: Path | None = None
    hf_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Env:
        e = os.environ if environ is None else environ
        state_dir = Path(e.get("LIBREYOLO_AGENT_STATE_DIR") or DEFAULT_STATE_DIR)
        endpoint = (e.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")
        if _url_scheme(endpoint) not in ("http", "https"):
            raise ConfigError("HF_ENDPOINT", f"{endpoint!r} is not an http(s) URL")
        hf_home = Path(e["HF_HOME"]) if e.get("HF_HOME") else None
        token = e.get("HF_TOKEN") or None
        return cls(state_dir=state_dir, hf_endpoint=endpoint, hf_home=hf_home, hf_token=token)


@dataclass(frozen=True)
class Job:
    job: JobSection
    train: TrainSection
    #: The Hub dataset to stage, or None when the job trains on a local ``train.data``.
    dataset: DatasetSection | None = None
    #: Checks of the data YAML (doctor, paths), for every job, staged or local.
    data_check: DataCheckSection = DataCheckSection()
    sync: SyncSection | None = None
    limits: LimitsSection = LimitsSection()
    teardown: TeardownSection = TeardownSection()
    server: ServerSection = ServerSection()
    preflight: PreflightSection = PreflightSection()
    #: Where the job came from (a path, or ``<demo>``); for messages only.
    source: str = "<memory>"


# --------------------------------------------------------------------------------------------
# Loading

#: A job file is a few hundred bytes; refuse to read a huge one (or /dev/zero) into memory.
MAX_JOB_FILE_BYTES = 1 << 20
#: TOML integers are 64-bit (toml.io: "an error must be thrown" past them); tomllib reads any size.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: ``[dataset]`` keys that stage a Hub dataset; without any of them the table only sets checks.
_STAGING_KEYS = ("repo", "file", "revision", "dest", "data_yaml")
#: LibreYOLO train options that end the command without training: the agent would read the
#: exit as a finished run and tear the box down with nothing trained.
_NON_TRAINING_KEYS = {
    "dry_run": "validates the options and exits without training",
    "help_json": "prints the option list and exits without training",
}


class _Table:
    """Reads one TOML table, remembering which keys were consumed so the rest can be refused."""

    def __init__(self, name: str, data: object) -> None:
        if not isinstance(data, dict):
            raise ConfigError(name, f"{_show(data)} must be a table ([{name}])")
        self.name = name
        self.data: dict[str, Any] = data
        self.used: set[str] = set()

    def key(self, k: str) -> str:
        return f"{self.name}.{k}"

    def _get(self, k: str, required: bool) -> Any:
        self.used.add(k)
        if k not in self.data:
            if required:
                raise ConfigError(self.key(k), "is required but missing")
            return None
        return self.data[k]

    def str_(self, k: str, default: str | None = None, *, required: bool = False) -> str | None:
        """A non-empty string of printable characters (names, paths, URLs, choices)."""
        v = self._get(k, required)
        if v is None:
            return default
        if not isinstance(v, str):
            raise ConfigError(self.key(k), f"{_show(v)} is not a string")
        if not v.strip():
            raise ConfigError(self.key(k), f"{_show(v)} must not be empty")
        _refuse_unprintable(self.key(k), v)
        return v

    def req_str(self, k: str) -> str:
        v = self.str_(k, required=True)
        assert v is not None
        return v

    def bool_(self, k: str, default: bool) -> bool:
        v = self._get(k, False)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(self.key(k), f"{_show(v)} is not a boolean (true or false)")
        return v

    def number(
        self, k: str, default: float | None, *, minimum: float = 0.0, strict: bool = False
    ) -> float | None:
        v = self._get(k, False)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(self.key(k), f"{_show(v)} is not a number")
        try:
            finite = math.isfinite(float(v))
        except OverflowError:
            finite = False
        if not finite:
            raise ConfigError(self.key(k), f"{_show(v)} is not a finite number")
        if v < minimum or (strict and v == minimum):
            rel = ">" if strict else ">="
            raise ConfigError(self.key(k), f"{_show(v)} must be {rel} {minimum:g}")
        return float(v)

    def int_(self, k: str, default: int, *, minimum: int) -> int:
        v = self._get(k, False)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(self.key(k), f"{_show(v)} is not an integer")
        if v < minimum:
            raise ConfigError(self.key(k), f"{_show(v)} must be >= {minimum}")
        return v

    def duration(self, k: str) -> float | None:
        v = self._get(k, False)
        return None if v is None else parse_duration(self.key(k), v)

    def choice(self, k: str, default: str, choices: tuple[str, ...]) -> str:
        v = self.str_(k, default)
        assert v is not None
        if v not in choices:
            raise ConfigError(self.key(k), f"{_show(v)} is not one of {', '.join(choices)}")
        return v

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            k = unknown[0]
            expected = ", ".join(sorted(self.used))
            raise ConfigError(self.key(k), f"unknown key (expected one of: {expected})")


def _url_scheme(url: str) -> str | None:
    try:
        return urlsplit(url).scheme
    except ValueError:
        return None


def _show(value: object) -> str:
    """``repr`` cut to 60 characters: control characters come out escaped."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's str() digit limit (hexadecimal TOML reads fine)
        assert isinstance(value, int)
        text = f"<an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits>"
    return text if len(text) <= 60 else text[:57] + "..."


def _printable(text: str) -> str:
    """``text`` with every unprintable character escaped as ``repr`` does: one safe line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _refuse_unprintable(key: str, value: str, *, lax: bool = False) -> None:
    """Refuse NUL, control characters, line breaks and (unless ``lax``) invisible ones.

    Strict is for names, paths, repo ids and URLs, where such a character is always a mistake
    (or a spoof: U+202E reverses the text shown). ``lax`` is for ``[train]`` values, passed on
    as one command-line argument each: only control characters and line breaks are refused."""
    for i, ch in enumerate(value):
        bad = unicodedata.category(ch) in ("Cc", "Zl", "Zp") if lax else not ch.isprintable()
        if bad:
            what = "a NUL character" if ch == "\x00" else f"the unprintable character {ch!a}"
            expected = "a single line of text" if lax else "printable text"
            raise ConfigError(
                key, f"{_show(value)} contains {what} at position {i}; expected {expected}"
            )


def _check_document(doc: Mapping[str, Any]) -> None:
    """Refuse, anywhere in the document, what no setting can use and later code trips over:
    NUL in a key or a string (it ends C strings: paths and argv fail at every restart) and an
    integer beyond TOML's 64-bit range (``str()`` of it may raise)."""
    for k in doc:
        if "\x00" in str(k):
            raise ConfigError(str(k), "the name contains a NUL character")
    stack: list[tuple[str, object]] = [(str(k), v) for k, v in reversed(list(doc.items()))]
    while stack:
        key, value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                i = value.index("\x00")
                raise ConfigError(key, f"{_show(value)} contains a NUL character at position {i}")
        elif isinstance(value, int) and not isinstance(value, bool):
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise ConfigError(key, f"{_show(value)} is outside TOML's 64-bit integer range")
        elif isinstance(value, Mapping):
            for k in value:
                if "\x00" in str(k):
                    raise ConfigError(f"{key}.{k}", "the key contains a NUL character")
            stack.extend((f"{key}.{k}", v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list | tuple):
            stack.extend((f"{key}[{i}]", v) for i, v in reversed(list(enumerate(value))))


#: A Hub repo id part (namespace or name), as ``huggingface_hub.utils.validate_repo_id`` checks
#: it (``REPO_ID_REGEX``, ASCII): 1-96 of ``[A-Za-z0-9_.-]``, not starting or ending with ``-``
#: or ``.``.
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def repo_id_problem(repo_id: str) -> str | None:
    """Why ``repo_id`` is not a Hub ``namespace/name`` repo id, or None when it is one.

    Mirrors ``huggingface_hub.utils.validate_repo_id`` (importing the library costs the agent's
    start-up a few hundred ms) plus the namespace the agent needs."""
    parts = repo_id.split("/")
    if len(parts) != 2:
        return "must be namespace/name, with exactly one '/'"
    if not all(_REPO_PART.fullmatch(p) for p in parts):
        hint = " ('@revision' is not part of a repo id)" if "@" in repo_id else ""
        return (
            "may use only letters, digits, '-', '_' and '.', not start or end either part with "
            f"'-' or '.', and have at most 96 characters per part{hint}"
        )
    if "--" in repo_id or ".." in repo_id:
        return "must not contain '--' or '..'"
    if repo_id.endswith(".git"):
        return "must not end in '.git'"
    return None


def _check_inside(key: str, value: str, where: str) -> None:
    """``value`` is a relative path that stays inside ``where`` (no ``..``, not absolute)."""
    if value.startswith(("/", "~")) or ".." in value.replace("\\", "/").split("/"):
        raise ConfigError(key, f"{_show(value)} must be a relative path inside {where}")


def _check_revision(key: str, value: str) -> None:
    if any(ch.isspace() for ch in value):
        raise ConfigError(key, f"{_show(value)} must be a branch, tag or commit (no spaces)")


def _is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_PROVIDERS = ("none",)
_PLANNED_PROVIDERS = ("vast", "runpod", "lambda", "command")
_ACTIONS = ("destroy", "stop", "keep")
_SECTIONS = (
    "job",
    "train",
    "dataset",
    "sync",
    "limits",
    "teardown",
    "server",
    "preflight",
)


def load_job(path: str | os.PathLike[str]) -> Job:
    """Read and validate a job file, ``[train]`` keys included against the installed LibreYOLO;
    raises :class:`ConfigError` and nothing else, whatever the file holds."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_JOB_FILE_BYTES + 1)
        base_dir = p.resolve().parent
    except OSError as exc:
        raise ConfigError(str(p), f"cannot read the job file: {exc.strerror or exc}") from None
    except RuntimeError as exc:  # a symlink loop, on Python 3.11
        raise ConfigError(str(p), f"cannot read the job file: {exc}") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise ConfigError(
            str(p),
            f"the job file is larger than {MAX_JOB_FILE_BYTES >> 20} MiB (a job file is a few "
            "hundred bytes): is it the right file?",
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(str(p), "the job file is not UTF-8 text") from None
    job = parse_job(text, source=str(p), base_dir=base_dir)
    check_train_options(job.train, installed_train_options())
    return job


def parse_job(text: str, *, source: str = "<string>", base_dir: Path | None = None) -> Job:
    """Parse TOML text into a :class:`Job`. Relative paths are resolved against ``base_dir``.

    ``[train]`` keys are not checked against LibreYOLO here (``load_job`` does it)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(source, "not valid TOML: nested too deeply") from None
    except ValueError as exc:
        # tomllib converts a decimal integer with int(), which refuses more than 4,300 digits
        # with a plain ValueError (https://docs.python.org/3/library/stdtypes.html#int-max-str-digits).
        raise ConfigError(source, f"not valid TOML: {_huge_integer(text) or exc}") from None
    return job_from_dict(doc, source=source, base_dir=base_dir)


def _huge_integer(text: str) -> str | None:
    limit = sys.get_int_max_str_digits() or 4300
    for m in re.finditer(rf"[0-9_]{{{limit + 1},}}", text):
        if len(m.group().replace("_", "")) > limit:
            line = text.count("\n", 0, m.start()) + 1
            return (
                f"the integer at line {line} has more than {limit} digits "
                "(TOML integers are 64-bit: at most 19 digits)"
            )
    return None


def job_from_dict(
    doc: Mapping[str, Any], *, source: str = "<dict>", base_dir: Path | None = None
) -> Job:
    """Validate a parsed job document into a :class:`Job` (see :func:`parse_job`)."""
    base = base_dir or Path.cwd()

    def path(value: str, key: str = "path") -> Path:
        try:
            p = Path(value).expanduser()
        except RuntimeError:  # "~nosuchuser/..."
            raise ConfigError(key, f"{value!r}: cannot expand '~' (no such user)") from None
        return p if p.is_absolute() else (base / p)

    _check_document(doc)
    unknown = sorted(set(doc) - set(_SECTIONS))
    if unknown:
        raise ConfigError(
            unknown[0] or repr(unknown[0]),
            f"unknown section (expected one of: {', '.join(_SECTIONS)})",
        )

    t = _Table("job", doc.get("job", {}))
    name = t.str_("name", "run1")
    assert name is not None
    if "/" in name or name in (".", ".."):
        raise ConfigError("job.name", f"{name!r} must be a plain name, not a path")
    if len(name.encode()) > 200:
        # LibreYOLO makes a directory of it (plus a number when it exists): 255 bytes at most.
        raise ConfigError("job.name", f"{_show(name)} is longer than 200 bytes")
    job_section = JobSection(
        name=name,
        runs_dir=path(t.str_("runs_dir", "runs") or "runs", "job.runs_dir"),
        stop_trainer_on_exit=t.bool_("stop_trainer_on_exit", False),
    )
    t.finish()

    dataset: DatasetSection | None = None
    data_check = DataCheckSection()
    if "dataset" in doc:
        t = _Table("dataset", doc["dataset"])
        data_check = DataCheckSection(
            doctor=t.bool_("doctor", True),
            allow_outside_paths=t.bool_("allow_outside_paths", False),
        )
        if any(k in t.data for k in _STAGING_KEYS):
            repo = t.req_str("repo")
            problem = repo_id_problem(repo)
            if problem:
                raise ConfigError("dataset.repo", f"{_show(repo)} is not a Hub repo id: {problem}")
            file = t.req_str("file")
            _check_inside("dataset.file", file, "the dataset repo")
            revision = t.str_("revision", "main") or "main"
            _check_revision("dataset.revision", revision)
            data_yaml = t.str_("data_yaml")
            if data_yaml is not None:
                _check_inside("dataset.data_yaml", data_yaml, "dataset.dest")
            dataset = DatasetSection(
                repo=repo,
                file=file,
                revision=revision,
                dest=path(t.str_("dest", "data") or "data", "dataset.dest"),
                doctor=data_check.doctor,
                data_yaml=data_yaml,
            )
        else:
            t.used.update(_STAGING_KEYS)  # listed as expected keys in an unknown key's message
        t.finish()

    train = _load_train(doc.get("train"), dataset, base)

    sync: SyncSection | None = None
    if "sync" in doc:
        t = _Table("sync", doc["sync"])
        target = t.req_str("target")
        _check_sync_target(target)
        sync = SyncSection(
            target=target,
            every_epochs=t.int_("every_epochs", 1, minimum=1),
            private=t.bool_("private", True),
            upload_timeout_s=t.duration("upload_timeout") or 600.0,
            max_backoff_s=t.duration("max_backoff") or 300.0,
            finish_timeout_s=t.duration("finish_timeout") or 1800.0,
        )
        t.finish()

    t = _Table("limits", doc.get("limits", {}))
    limits = LimitsSection(
        max_runtime_s=t.duration("max_runtime"),
        stall_timeout_s=t.duration("stall_timeout"),
        budget_usd=t.number("budget_usd", None, strict=True),
        price_usd_per_hour=t.number("price_usd_per_hour", None),
    )
    t.finish()
    if limits.budget_usd is not None and not limits.price_usd_per_hour:
        price = limits.price_usd_per_hour
        raise ConfigError(
            "limits.price_usd_per_hour",
            ("is missing" if price is None else f"{price:g} is too low")
            + f": budget_usd needs price_usd_per_hour > 0 (budget_usd = {limits.budget_usd:g}); "
            "without a price the budget never stops the job",
        )

    t = _Table("teardown", doc.get("teardown", {}))
    provider = t.str_("provider", "none") or "none"
    if provider in _PLANNED_PROVIDERS:
        raise ConfigError(
            "teardown.provider",
            f"{provider!r} is not built yet in this version; use 'none' "
            "(the agent then records the action it would take)",
        )
    if provider not in _PROVIDERS:
        raise ConfigError(
            "teardown.provider",
            f"{_show(provider)} is not one of {', '.join(_PROVIDERS + _PLANNED_PROVIDERS)}",
        )
    teardown = TeardownSection(
        provider=provider,
        on_success=t.choice("on_success", "destroy", _ACTIONS),
        on_failure=t.choice("on_failure", "stop", _ACTIONS),
        on_preflight_failure=t.choice("on_preflight_failure", "destroy", _ACTIONS),
        require_verified_sync=t.bool_("require_verified_sync", True),
    )
    t.finish()

    t = _Table("server", doc.get("server", {}))
    listen = t.str_("listen", DEFAULT_LISTEN) or DEFAULT_LISTEN
    server = _parse_listen(listen, allow_remote=t.bool_("allow_remote", False))
    t.finish()

    t = _Table("preflight", doc.get("preflight", {}))
    preflight = PreflightSection(
        enabled=t.bool_("enabled", True),
        allow_cpu=t.bool_("allow_cpu", False),
        timeout_s=t.duration("timeout") or 120.0,
        deep_import=t.bool_("deep_import", False),
    )
    t.finish()

    return Job(
        job=job_section,
        train=train,
        dataset=dataset,
        data_check=data_check,
        sync=sync,
        limits=limits,
        teardown=teardown,
        server=server,
        preflight=preflight,
        source=source,
    )


def _check_sync_target(target: str) -> None:
    try:
        parsed = urlsplit(target)
    except ValueError as exc:  # e.g. an unbalanced '[' reads as a broken IPv6 host
        raise ConfigError("sync.target", f"{_show(target)} is not a valid URL ({exc})") from None
    if parsed.scheme == "file":
        if not parsed.path.startswith("/") or parsed.netloc:
            raise ConfigError(
                "sync.target", f"{_show(target)} must be an absolute file:///path (three slashes)"
            )
        if "?" in target or "#" in target:
            # urlsplit would cut the path there: the checkpoints would land in another folder.
            raise ConfigError(
                "sync.target", f"{_show(target)}: a file:/// path cannot contain '?' or '#'"
            )
    elif parsed.scheme == "hf":
        _, sep, rest = target.partition("://")
        repo = rest.rstrip("/") if sep else ""
        problem = repo_id_problem(repo)
        if problem:
            raise ConfigError(
                "sync.target",
                f"{_show(target)} must be hf://namespace/name, a Hub repo id that {problem}",
            )
    else:
        raise ConfigError(
            "sync.target",
            f"{_show(target)} must start with file:/// or hf:// (got {parsed.scheme!r})",
        )


def _load_train(raw: object, dataset: DatasetSection | None, base: Path) -> TrainSection:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("train", f"{_show(raw)} must be a table ([train])")
    args: list[tuple[str, TrainValue]] = []
    stop_grace = 60.0
    kill_grace = 10.0
    for k, v in raw.items():
        key = f"train.{k}"
        if k == "stop_grace":
            stop_grace = parse_duration(key, v)
            continue
        if k == "kill_grace":
            kill_grace = parse_duration(key, v)
            continue
        if k in RESERVED_TRAIN_KEYS:
            raise ConfigError(
                key,
                "is set by the agent; use job.name / job.runs_dir instead"
                if k != "json"
                else "is set by the agent (it always reads LibreYOLO's json result)",
            )
        if k in _NON_TRAINING_KEYS:
            raise ConfigError(
                key, f"{_NON_TRAINING_KEYS[k]}; the agent would read that as a finished run"
            )
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ConfigError(key, "is not a valid LibreYOLO option name")
        if isinstance(v, bool | int | str) or (isinstance(v, float) and math.isfinite(v)):
            if isinstance(v, str):
                _refuse_unprintable(key, v, lax=True)
            if k in _PATH_TRAIN_KEYS and isinstance(v, str) and not Path(v).is_absolute():
                # The trainer runs in runs_dir: a file beside the job file is made absolute,
                # while names LibreYOLO resolves itself ("coco8.yaml", "yolox-n") stay as given.
                with contextlib.suppress(OSError, RuntimeError, ValueError):
                    if (base / v).exists():
                        v = str(base / v)
            args.append((k, v))
        else:
            raise ConfigError(key, f"{_show(v)} must be a string, number or boolean")
    section = TrainSection(args=tuple(args), stop_grace_s=stop_grace, kill_grace_s=kill_grace)
    if section.get("data") is None:
        if dataset is None or dataset.data_yaml is None:
            raise ConfigError(
                "train.data",
                "is required (the dataset YAML), or set dataset.data_yaml to take it from the "
                "staged dataset",
            )
        args.append(("data", str(dataset.dest / dataset.data_yaml)))
        section = TrainSection(args=tuple(args), stop_grace_s=stop_grace, kill_grace_s=kill_grace)
    epochs = section.get("epochs")
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1
    ):
        raise ConfigError("train.epochs", f"{_show(epochs)} must be an integer >= 1")
    return section


def check_train_options(train: TrainSection, options: TrainOptions) -> None:
    """Refuse a ``[train]`` key that the installed LibreYOLO's ``train`` command does not have,
    naming the closest valid ones; nothing to check (no error) when ``options`` are unknown,
    e.g. an agent-only install. The agent's own ``stop_grace``/``kill_grace`` never get here."""
    if not options.available:
        return
    for k, v in train.args:
        if k in options.names:
            continue
        close = options.close_matches(k)
        hint = (
            f"did you mean {' or '.join(close)}?"
            if close
            else "`libreyolo train --help` lists them"
        )
        raise ConfigError(
            f"train.{k}",
            f"unknown option (value {_show(v)}): `libreyolo train` of {options.label} has no "
            f"{k!r}; {hint}",
        )


_HOSTNAME = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def _parse_listen(listen: str, *, allow_remote: bool) -> ServerSection:
    expected = f"host:port (e.g. {DEFAULT_LISTEN!r}, '[::1]:8421')"
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ConfigError("server.listen", f"{_show(listen)} is not {expected}")
    # Length first: int() of a 5,000-digit text raises ValueError.
    if len(port_text) > 5 or int(port_text) > 65535:
        raise ConfigError("server.listen", f"{_show(listen)}: the port must be 0 to 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(
                "server.listen", f"{_show(listen)}: {host!r} in brackets is not an IPv6 address"
            ) from None
    elif host == "*":
        raise ConfigError(
            "server.listen",
            f"{_show(listen)}: '*' is not a host; to listen on every interface write "
            "0.0.0.0:PORT (or [::]:PORT) and set server.allow_remote = true",
        )
    elif ":" in host:
        raise ConfigError(
            "server.listen", f"{_show(listen)}: write an IPv6 address in brackets ([::1]:8421)"
        )
    elif not _HOSTNAME.fullmatch(host) or (host.replace(".", "").isdigit() and not _is_ipv4(host)):
        raise ConfigError(
            "server.listen", f"{_show(listen)}: {host!r} is not an IP address or host name"
        )
    if not allow_remote and not _is_loopback(host):
        raise ConfigError(
            "server.listen",
            f"{_show(listen)} is not a loopback address (127.0.0.1, [::1], localhost): anyone "
            "who can reach it could read /status. Reach the agent through an SSH tunnel, or "
            "set server.allow_remote = true",
        )
    return ServerSection(host=host, port=int(port_text), allow_remote=allow_remote)


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True
