"""The job file (TOML) and the environment, validated once into frozen dataclasses.

Every error names the key, the value and what was expected, so that ``libreyolo-agent check``
can print one line and exit 2. Unknown keys are errors: a typo must never be silently ignored
on a box that bills by the hour.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

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
    """A job file or environment value is wrong. The message names the key and the fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


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
    #: Hugging Face dataset repo (``org/name``) holding one archive of the dataset.
    repo: str
    #: Archive file name inside the repo (.tar, .tar.gz/.tgz, .tar.bz2, .tar.xz, .zip).
    file: str
    #: Branch, tag or commit to download.
    revision: str = "main"
    #: Directory the archive is unpacked into.
    dest: Path = Path("data")
    #: Run ``libreyolo doctor`` on the unpacked data; its errors stop the job before training.
    doctor: bool = False
    #: Path of the data YAML inside ``dest``; used as ``train.data`` when that is not set.
    data_yaml: str | None = None


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
        return urlparse(self.target).scheme

    @property
    def location(self) -> str:
        """The folder (``file://``) or ``org/repo`` (``hf://``) of the target."""
        parsed = urlparse(self.target)
        if parsed.scheme == "file":
            return parsed.path
        return (parsed.netloc + parsed.path).strip("/")


@dataclass(frozen=True)
class LimitsSection:
    #: Wall-clock limit of the training phase, seconds.
    max_runtime_s: float | None = None
    #: Training counts as stalled when status.json has not moved on for this long, seconds.
    stall_timeout_s: float | None = None
    budget_usd: float | None = None
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
    host: str = "127.0.0.1"
    #: TCP port; 0 picks a free one (tests); the bound port is written to state.json.
    port: int = 8421


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
    dataset: DatasetSection | None = None
    sync: SyncSection | None = None
    limits: LimitsSection = LimitsSection()
    teardown: TeardownSection = TeardownSection()
    server: ServerSection = ServerSection()
    preflight: PreflightSection = PreflightSection()
    #: Where the job came from (a path, or ``<demo>``); for messages only.
    source: str = "<memory>"


# --------------------------------------------------------------------------------------------
# Loading

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


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
        v = self._get(k, required)
        if v is None:
            return default
        if not isinstance(v, str):
            raise ConfigError(self.key(k), f"{_show(v)} is not a string")
        if not v.strip():
            raise ConfigError(self.key(k), "must not be empty")
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
            raise ConfigError(self.key(k), f"{v!r} is not one of {', '.join(choices)}")
        return v

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            k = unknown[0]
            expected = ", ".join(sorted(self.used))
            raise ConfigError(self.key(k), f"unknown key (expected one of: {expected})")


def _url_scheme(url: str) -> str | None:
    try:
        return urlparse(url).scheme
    except ValueError:
        return None


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    """Read and validate a job file; raises :class:`ConfigError` (also for unreadable files)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(str(p), f"cannot read the job file: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(str(p), "the job file is not UTF-8 text") from None
    return parse_job(text, source=str(p), base_dir=p.resolve().parent)


def parse_job(text: str, *, source: str = "<string>", base_dir: Path | None = None) -> Job:
    """Parse TOML text into a :class:`Job`. Relative paths are resolved against ``base_dir``."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(source, "not valid TOML: nested too deeply") from None
    return job_from_dict(doc, source=source, base_dir=base_dir)


def job_from_dict(
    doc: Mapping[str, Any], *, source: str = "<dict>", base_dir: Path | None = None
) -> Job:
    base = base_dir or Path.cwd()

    def path(value: str, key: str = "path") -> Path:
        try:
            p = Path(value).expanduser()
        except RuntimeError:  # "~nosuchuser/..."
            raise ConfigError(key, f"{value!r}: cannot expand '~' (no such user)") from None
        return p if p.is_absolute() else (base / p)

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
    job_section = JobSection(
        name=name,
        runs_dir=path(t.str_("runs_dir", "runs") or "runs", "job.runs_dir"),
        stop_trainer_on_exit=t.bool_("stop_trainer_on_exit", False),
    )
    t.finish()

    dataset: DatasetSection | None = None
    if "dataset" in doc:
        t = _Table("dataset", doc["dataset"])
        repo = t.req_str("repo")
        if repo.count("/") != 1 or repo.startswith("/") or repo.endswith("/"):
            raise ConfigError("dataset.repo", f"{repo!r} is not of the form 'org/name'")
        data_yaml = t.str_("data_yaml")
        dataset = DatasetSection(
            repo=repo,
            file=t.req_str("file"),
            revision=t.str_("revision", "main") or "main",
            dest=path(t.str_("dest", "data") or "data", "dataset.dest"),
            doctor=t.bool_("doctor", False),
            data_yaml=data_yaml,
        )
        t.finish()

    train = _load_train(doc.get("train"), dataset, base)

    sync: SyncSection | None = None
    if "sync" in doc:
        t = _Table("sync", doc["sync"])
        target = t.req_str("target")
        try:
            parsed = urlparse(target)
        except ValueError as exc:  # e.g. an unbalanced '[' reads as a broken IPv6 host
            raise ConfigError("sync.target", f"{target!r} is not a valid URL ({exc})") from None
        if parsed.scheme == "file":
            if not parsed.path.startswith("/") or parsed.netloc:
                raise ConfigError(
                    "sync.target", f"{target!r} must be an absolute file:///path (three slashes)"
                )
        elif parsed.scheme == "hf":
            repo = (parsed.netloc + parsed.path).strip("/")
            if repo.count("/") != 1:
                raise ConfigError("sync.target", f"{target!r} must be hf://org/repo")
        else:
            raise ConfigError(
                "sync.target",
                f"{target!r} must start with file:/// or hf:// (got {parsed.scheme!r})",
            )
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
    if limits.budget_usd is not None and limits.price_usd_per_hour is None:
        raise ConfigError("limits.price_usd_per_hour", "is required when limits.budget_usd is set")

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
            f"{provider!r} is not one of {', '.join(_PROVIDERS + _PLANNED_PROVIDERS)}",
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
    server = _parse_listen(listen)
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
        sync=sync,
        limits=limits,
        teardown=teardown,
        server=server,
        preflight=preflight,
        source=source,
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
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ConfigError(key, "is not a valid LibreYOLO option name")
        if isinstance(v, bool | int | str) or (isinstance(v, float) and math.isfinite(v)):
            if isinstance(v, str) and ("\n" in v or "\x00" in v):
                raise ConfigError(key, f"{_show(v)} must be a single line")
            if k in _PATH_TRAIN_KEYS and isinstance(v, str) and not Path(v).is_absolute():
                # The trainer runs in runs_dir: a file beside the job file is made absolute,
                # while names LibreYOLO resolves itself ("coco8.yaml", "yolox-n") stay as given.
                with contextlib.suppress(OSError, RuntimeError):
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


def _parse_listen(listen: str) -> ServerSection:
    host, sep, port_text = listen.rpartition(":")
    if (
        not sep
        or not host
        or not (port_text.isascii() and port_text.isdigit())
        or int(port_text) > 65535
    ):
        raise ConfigError("server.listen", f"{listen!r} is not host:port (e.g. {DEFAULT_LISTEN!r})")
    host = host.strip("[]")
    return ServerSection(host=host, port=int(port_text))
