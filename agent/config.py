"""The job file (TOML) and the environment, validated once into frozen dataclasses.

Every error names the key, the value and what was expected, so that ``libreyolo-agent check``
can print one line per mistake and exit 2; every mistake of a file is reported at once
(:class:`ConfigErrors`). Unknown keys are errors: a typo must never be silently ignored on a box
that bills by the hour. The checks of single values live in :mod:`agent.jobvalues`; the
defaults live once, in the dataclasses below.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, get_args
from urllib.parse import urlsplit

from .jobvalues import ConfigError as ConfigError
from .jobvalues import ConfigErrors as ConfigErrors
from .jobvalues import (
    ErrorList,
    Table,
    check_api_url,
    check_document,
    check_inside,
    check_revision,
    check_sync_target,
    huge_integer_problem,
    instance_id_problem,
    is_loopback,
    parse_listen,
    refuse_unprintable,
    show,
    url_scheme,
)
from .jobvalues import format_duration as format_duration
from .jobvalues import parse_duration as parse_duration
from .jobvalues import repo_id_problem as repo_id_problem
from .trainargs import TrainOptions, installed_train_options

#: Default state directory (env ``LIBREYOLO_AGENT_STATE_DIR`` overrides it).
DEFAULT_STATE_DIR = Path("/var/lib/libreyolo-agent")
DEFAULT_HF_ENDPOINT = "https://huggingface.co"

#: ``[train]`` keys whose relative values name files beside the job file.
_PATH_TRAIN_KEYS = frozenset({"data", "model"})
#: ``[train]`` keys the agent sets itself; a job may not set them.
RESERVED_TRAIN_KEYS = frozenset({"project", "name", "json"})

TrainValue = str | int | float | bool

# --------------------------------------------------------------------------------------------
# Sections


#: What happens to the box at the end: ``destroy`` (billing ends, disk gone), ``stop`` (the
#: disk survives for cents an hour), ``keep`` (the box stays up).
TeardownAction = Literal["destroy", "stop", "keep"]


#: Who carries out the teardown: a cloud provider's API (``vast``, ``runpod``, ``lambda``), a
#: command of the job's (``command``) or nobody (``none``: a dry run that records the action).
ProviderName = Literal["vast", "runpod", "lambda", "command", "none"]


def teardown_provider(doc: Mapping[str, Any]) -> str:
    """The provider a raw job document names (for cross-section checks)."""
    td = doc.get("teardown")
    value = td.get("provider", "none") if isinstance(td, dict) else "none"
    return value if isinstance(value, str) else "none"


def as_action(value: str) -> TeardownAction:
    """``value`` as a :data:`TeardownAction` (a state file or job file read it as a string)."""
    if value in get_args(TeardownAction):
        return cast(TeardownAction, value)
    raise ValueError(f"not a teardown action: {value!r}")


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
    #: Seconds to wait after SIGINT (LibreYOLO's clean stop) before SIGTERM (``train.stop_grace``).
    stop_grace_s: float = 60.0
    #: Seconds to wait after SIGTERM before SIGKILL to the whole tree (``train.kill_grace``).
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
    """Limits on the job, checked while training runs; reaching one stops the trainer and
    ends the job with reason ``timeout``, ``stalled`` or ``budget``. Default: none set."""

    #: Wall-clock limit of the job, seconds, counted from the agent's first boot for this job
    #: (persisted in state.json, so a restarted agent does not get a fresh allowance):
    #: preflight and staging count. Job file: ``limits.max_runtime`` (a duration).
    max_runtime_s: float | None = None
    #: Training counts as stalled when status.json has not moved on for this long, seconds
    #: (counted from the last progress). Job file: ``limits.stall_timeout`` (a duration).
    stall_timeout_s: float | None = None
    #: Stop the job once the box has cost this much (USD), counted from the agent's first boot
    #: for this job at ``price_usd_per_hour``; needs ``price_usd_per_hour`` > 0.
    budget_usd: float | None = None
    #: What the box costs per hour (USD), for the budget and the cost figures; >= 0.
    price_usd_per_hour: float | None = None
    #: ``price_usd_per_hour = "auto"``: read this instance's real price from the provider
    #: (Vast's per-instance dollars per hour, RunPod's cost per hour, Lambda's instance type).
    price_auto: bool = False
    #: Refuse to train on a box that costs more (USD per hour): preflight fails and the box is
    #: torn down at once (nothing was trained). Needs a price (given or ``auto``).
    max_price_usd_per_hour: float | None = None
    #: What the provider charges for storage (USD per GB-month), for the "stopped, the box
    #: costs" figure in /status: allocated GB x this / 720 (``libreyolo-agent cost``).
    storage_usd_per_gb_month: float | None = None


@dataclass(frozen=True)
class TeardownSection:
    #: Who tears the box down: ``vast``, ``runpod``, ``lambda`` (their APIs, keys from the
    #: environment), ``command`` (``teardown.command``) or ``none`` (default: records the action
    #: it would take and does nothing).
    provider: ProviderName = "none"
    #: What to do with the box when training completed: ``destroy``, ``stop`` or ``keep``.
    on_success: TeardownAction = "destroy"
    #: What to do after any other outcome (the box holds checkpoints: keep its disk).
    on_failure: TeardownAction = "stop"
    #: What to do when preflight (or staging) failed: nothing was trained, the box is bad.
    on_preflight_failure: TeardownAction = "destroy"
    #: Never destroy or stop the box unless every checkpoint upload was verified.
    require_verified_sync: bool = True
    #: Base URL of the provider's API, the part before ``/api/v0`` (vast), ``/v2`` (runpod) or
    #: ``/api/v1`` (lambda), without a trailing ``/``: for proxies, mirrors and tests. Default
    #: None: the provider's own (``https://console.vast.ai``, ``https://api.runpod.io``,
    #: ``https://cloud.lambda.ai``).
    api_url: str | None = None
    #: This box's instance id at the provider. Default None: from the environment
    #: (``CONTAINER_ID`` on Vast, ``RUNPOD_POD_ID`` on RunPod) or, on Lambda, the one instance
    #: of the account whose IP address or host name is this machine's.
    instance_id: str | None = None
    #: ``provider = "command"``: the argv that destroys the box, run without a shell (e.g.
    #: ``["shutdown", "-h", "now"]`` on EC2 with InstanceInitiatedShutdownBehavior=terminate).
    #: Its exit status is the result: it cannot be read back. Required with that provider.
    command: tuple[str, ...] = ()
    #: ``provider = "command"``: the argv that stops the box (its disk survives). Default (): the
    #: command provider cannot stop, and a stop keeps the box.
    stop_command: tuple[str, ...] = ()
    #: Seconds ``command`` / ``stop_command`` may run before they are killed
    #: (``teardown.command_timeout``, a duration; default 5 minutes).
    command_timeout_s: float = 300.0

    @property
    def can_stop(self) -> bool:
        """Whether this provider can stop the box (keep its disk, end the GPU bill): Lambda has
        no stop; ``command`` only with a ``stop_command``."""
        if self.provider == "lambda":
            return False
        if self.provider == "command":
            return bool(self.stop_command)
        return True


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
        return is_loopback(self.host)


_SERVER_DEFAULTS = ServerSection()
#: Default HTTP listen address; 8420 is taken by ``libreyolo monitor``.
DEFAULT_LISTEN = f"{_SERVER_DEFAULTS.host}:{_SERVER_DEFAULTS.port}"


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
    #: Vast: this instance's id (``CONTAINER_ID``, set by Vast in every instance).
    container_id: str | None = None
    #: Vast: the per-instance key Vast puts in every instance (``CONTAINER_API_KEY``); it can
    #: start, stop and destroy that instance only. Preferred over ``vast_api_key``.
    container_api_key: str | None = field(default=None, repr=False)
    #: Vast: an account key (``VAST_API_KEY``), used when ``CONTAINER_API_KEY`` is not set.
    vast_api_key: str | None = field(default=None, repr=False)
    #: RunPod: this pod's id (``RUNPOD_POD_ID``, set by RunPod in every pod).
    runpod_pod_id: str | None = None
    #: RunPod: ``RUNPOD_API_KEY`` (RunPod sets a pod-scoped one in every pod).
    runpod_api_key: str | None = field(default=None, repr=False)
    #: Lambda: ``LAMBDA_API_KEY`` (an account key: Lambda puts none on the instance).
    lambda_api_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Env:
        e = os.environ if environ is None else environ
        state_dir = Path(e.get("LIBREYOLO_AGENT_STATE_DIR") or DEFAULT_STATE_DIR)
        endpoint = (e.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")
        if url_scheme(endpoint) not in ("http", "https"):
            raise ConfigError("HF_ENDPOINT", f"{endpoint!r} is not an http(s) URL")
        hf_home = Path(e["HF_HOME"]) if e.get("HF_HOME") else None
        token = e.get("HF_TOKEN") or None

        def value(name: str) -> str | None:
            # A key pasted with its newline would make an invalid HTTP header.
            return (e.get(name) or "").strip() or None

        return cls(
            state_dir=state_dir,
            hf_endpoint=endpoint,
            hf_home=hf_home,
            hf_token=token,
            container_id=value("CONTAINER_ID"),
            container_api_key=value("CONTAINER_API_KEY"),
            vast_api_key=value("VAST_API_KEY"),
            runpod_pod_id=value("RUNPOD_POD_ID"),
            runpod_api_key=value("RUNPOD_API_KEY"),
            lambda_api_key=value("LAMBDA_API_KEY"),
        )

    def secrets(self) -> tuple[tuple[str, str], ...]:
        """Every secret that is set, as ``(variable, value)``: what messages must redact."""
        named = (
            ("HF_TOKEN", self.hf_token),
            ("CONTAINER_API_KEY", self.container_api_key),
            ("VAST_API_KEY", self.vast_api_key),
            ("RUNPOD_API_KEY", self.runpod_api_key),
            ("LAMBDA_API_KEY", self.lambda_api_key),
        )
        return tuple((name, v) for name, v in named if v)


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
#: ``[dataset]`` keys that stage a Hub dataset; without any of them the table only sets checks.
_STAGING_KEYS = ("repo", "file", "revision", "dest", "data_yaml")
#: LibreYOLO train options that end the command without training: the agent would read the
#: exit as a finished run and tear the box down with nothing trained.
_NON_TRAINING_KEYS = {
    "dry_run": "validates the options and exits without training",
    "help_json": "prints the option list and exits without training",
}
_PROVIDERS: tuple[ProviderName, ...] = get_args(ProviderName)
#: What each API provider appends to ``teardown.api_url``.
_API_PATHS = {"vast": "/api/v0", "runpod": "/v2", "lambda": "/api/v1"}
#: Why a ``stop`` cannot be carried out, for the providers that have none.
_NO_STOP = {
    "lambda": "Lambda has no stop: use destroy (gated: an unverified sync keeps the box) or keep",
    "command": "the command provider stops only with teardown.stop_command: set it, or use "
    "destroy (gated: an unverified sync keeps the box) or keep",
}
_ACTIONS: tuple[TeardownAction, ...] = get_args(TeardownAction)
_SECTIONS = ("job", "train", "dataset", "sync", "limits", "teardown", "server", "preflight")


def load_job(path: str | os.PathLike[str]) -> Job:
    """Read and validate a job file, ``[train]`` keys included against the installed LibreYOLO;
    raises :class:`ConfigError` (:class:`ConfigErrors` for several mistakes) and nothing else,
    whatever the file holds."""
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
    return parse_job(
        text, source=str(p), base_dir=base_dir, train_options=installed_train_options()
    )


def parse_job(
    text: str,
    *,
    source: str = "<string>",
    base_dir: Path | None = None,
    train_options: TrainOptions | None = None,
) -> Job:
    """Parse TOML text into a :class:`Job`. Relative paths are resolved against ``base_dir``.

    ``[train]`` keys are checked against ``train_options`` when given (``load_job`` gives the
    installed LibreYOLO's)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(source, "not valid TOML: nested too deeply") from None
    except ValueError as exc:
        # tomllib converts a decimal integer with int(), which refuses more than 4,300 digits
        # with a plain ValueError (https://docs.python.org/3/library/stdtypes.html#int-max-str-digits).
        raise ConfigError(source, f"not valid TOML: {huge_integer_problem(text) or exc}") from None
    return job_from_dict(doc, source=source, base_dir=base_dir, train_options=train_options)


def job_from_dict(
    doc: Mapping[str, Any],
    *,
    source: str = "<dict>",
    base_dir: Path | None = None,
    train_options: TrainOptions | None = None,
) -> Job:
    """Validate a parsed job document into a :class:`Job` (see :func:`parse_job`).

    Every mistake is collected, at most one per key, and raised together. A NUL character or an
    integer outside TOML's range is reported alone first: later checks could trip over it."""
    base = base_dir or Path.cwd()
    errors = ErrorList()
    check_document(doc, errors)
    errors.raise_if_any()

    def path(value: str, key: str) -> Path:
        try:
            p = Path(value).expanduser()
        except RuntimeError:  # "~nosuchuser/..."
            errors.add(ConfigError(key, f"{value!r}: cannot expand '~' (no such user)"))
            p = Path(value)
        return p if p.is_absolute() else (base / p)

    for name in sorted(set(doc) - set(_SECTIONS)):
        errors.add(
            ConfigError(
                name or repr(name), f"unknown section (expected one of: {', '.join(_SECTIONS)})"
            )
        )

    t = Table("job", doc.get("job", {}), errors)
    d_job = JobSection()
    name = t.str_("name", d_job.name) or d_job.name
    if "/" in name or name in (".", ".."):
        t.bad("name", f"{name!r} must be a plain name, not a path")
    elif len(name.encode()) > 200:
        # LibreYOLO makes a directory of it (plus a number when it exists): 255 bytes at most.
        t.bad("name", f"{show(name)} is longer than 200 bytes")
    job_section = JobSection(
        name=name,
        runs_dir=path(t.str_("runs_dir") or str(d_job.runs_dir), "job.runs_dir"),
        stop_trainer_on_exit=t.bool_("stop_trainer_on_exit", d_job.stop_trainer_on_exit),
    )
    t.finish()

    dataset: DatasetSection | None = None
    data_check = DataCheckSection()
    if "dataset" in doc:
        t = Table("dataset", doc["dataset"], errors)
        data_check = DataCheckSection(
            doctor=t.bool_("doctor", data_check.doctor),
            allow_outside_paths=t.bool_("allow_outside_paths", data_check.allow_outside_paths),
        )
        if any(k in t.data for k in _STAGING_KEYS):
            dataset = _load_staging(t, data_check, path)
        else:
            t.used.update(_STAGING_KEYS)  # listed as expected keys in an unknown key's message
        t.finish()

    train = _load_train(doc.get("train"), dataset, base, errors)
    if train_options is not None:
        with errors.catch():
            check_train_options(train, train_options)

    sync: SyncSection | None = None
    if "sync" in doc:
        t = Table("sync", doc["sync"], errors)
        target = t.req_str("target")
        if target is not None:
            with errors.catch():
                check_sync_target("sync.target", target)
        d_sync = SyncSection(target="")
        sync = SyncSection(
            target=target or "",
            every_epochs=t.int_("every_epochs", d_sync.every_epochs, minimum=1),
            private=t.bool_("private", d_sync.private),
            upload_timeout_s=t.duration("upload_timeout", d_sync.upload_timeout_s),
            max_backoff_s=t.duration("max_backoff", d_sync.max_backoff_s),
            finish_timeout_s=t.duration("finish_timeout", d_sync.finish_timeout_s),
        )
        t.finish()

    t = Table("limits", doc.get("limits", {}), errors)
    d_limits = LimitsSection()
    price_auto = (
        doc.get("limits", {}).get("price_usd_per_hour") == "auto"
        if isinstance(doc.get("limits"), dict)
        else False
    )
    limits = LimitsSection(
        max_runtime_s=t.duration("max_runtime", d_limits.max_runtime_s),
        stall_timeout_s=t.duration("stall_timeout", d_limits.stall_timeout_s),
        budget_usd=t.number("budget_usd", d_limits.budget_usd, strict=True),
        price_usd_per_hour=None
        if price_auto and t.str_("price_usd_per_hour")
        else t.number("price_usd_per_hour", d_limits.price_usd_per_hour),
        price_auto=price_auto,
        max_price_usd_per_hour=t.number(
            "max_price_usd_per_hour", d_limits.max_price_usd_per_hour, strict=True
        ),
        storage_usd_per_gb_month=t.number(
            "storage_usd_per_gb_month", d_limits.storage_usd_per_gb_month
        ),
    )
    t.finish()
    if price_auto and teardown_provider(doc) in ("none", "command"):
        t.bad(
            "price_usd_per_hour",
            f"'auto' needs a provider that reports the price (vast, runpod, lambda), not "
            f"teardown.provider = {teardown_provider(doc)!r}: give the price as a number",
        )
    if limits.max_price_usd_per_hour is not None and not (
        limits.price_auto or limits.price_usd_per_hour
    ):
        t.bad(
            "max_price_usd_per_hour",
            "needs a price to compare with: set price_usd_per_hour (a number or 'auto')",
        )
    if limits.budget_usd is not None and not (limits.price_usd_per_hour or limits.price_auto):
        price = limits.price_usd_per_hour
        t.bad(
            "price_usd_per_hour",
            ("is missing" if price is None else f"{price:g} is too low")
            + f": budget_usd needs price_usd_per_hour > 0 (budget_usd = {limits.budget_usd:g}); "
            "without a price the budget never stops the job",
        )

    teardown = _load_teardown(Table("teardown", doc.get("teardown", {}), errors))

    t = Table("server", doc.get("server", {}), errors)
    server = ServerSection()
    listen = t.str_("listen", DEFAULT_LISTEN) or DEFAULT_LISTEN
    allow_remote = t.bool_("allow_remote", server.allow_remote)
    with errors.catch():
        # A wrong allow_remote is already reported: do not add "not loopback" as its echo.
        remote_ok = allow_remote or errors.named("server.allow_remote")
        host, port = parse_listen("server.listen", listen, allow_remote=remote_ok)
        server = ServerSection(host=host, port=port, allow_remote=allow_remote)
    t.finish()

    t = Table("preflight", doc.get("preflight", {}), errors)
    d_pre = PreflightSection()
    preflight = PreflightSection(
        enabled=t.bool_("enabled", d_pre.enabled),
        allow_cpu=t.bool_("allow_cpu", d_pre.allow_cpu),
        timeout_s=t.duration("timeout", d_pre.timeout_s),
        deep_import=t.bool_("deep_import", d_pre.deep_import),
    )
    t.finish()

    errors.raise_if_any()
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


def _load_teardown(t: Table) -> TeardownSection:
    """The ``[teardown]`` table: a provider, its settings, and actions it can carry out."""
    d = TeardownSection()
    provider = t.str_("provider", d.provider) or d.provider
    if provider not in _PROVIDERS:
        t.bad("provider", f"{show(provider)} is not one of {', '.join(_PROVIDERS)}")
        provider = d.provider
    name: ProviderName = provider
    api_url = t.str_("api_url")
    if api_url is not None:
        if name in _API_PATHS:
            with t.errors.catch():
                api_url = check_api_url("teardown.api_url", api_url, _API_PATHS[name])
        else:
            t.bad("api_url", f"is only used by {', '.join(_API_PATHS)} (provider is {name!r})")
    instance_id = t.str_("instance_id")
    if instance_id is not None:
        problem = instance_id_problem(instance_id)
        if name not in _API_PATHS:
            t.bad("instance_id", f"is only used by {', '.join(_API_PATHS)} (provider is {name!r})")
        elif problem:
            t.bad("instance_id", f"{show(instance_id)} {problem}")
    command = t.argv("command")
    stop_command = t.argv("stop_command")
    timeout_s = t.duration("command_timeout", d.command_timeout_s)
    for key, value in (("command", command), ("stop_command", stop_command)):
        if value and name != "command":
            t.bad(key, f"is only used by provider 'command' (provider is {name!r})")
    if name == "command" and not command and not t.errors.named("teardown.command"):
        t.bad("command", 'is required with provider "command" (e.g. ["shutdown", "-h", "now"])')
    if "command_timeout" in t.data and name != "command":
        t.bad("command_timeout", f"is only used by provider 'command' (provider is {name!r})")
    teardown = TeardownSection(
        provider=name,
        on_success=as_action(t.choice("on_success", d.on_success, _ACTIONS)),
        on_failure=as_action(t.choice("on_failure", d.on_failure, _ACTIONS)),
        on_preflight_failure=as_action(
            t.choice("on_preflight_failure", d.on_preflight_failure, _ACTIONS)
        ),
        require_verified_sync=t.bool_("require_verified_sync", d.require_verified_sync),
        api_url=api_url,
        instance_id=instance_id,
        command=command if name == "command" else (),
        stop_command=stop_command if name == "command" else (),
        command_timeout_s=timeout_s,
    )
    t.finish()
    if not teardown.can_stop:
        for key in ("on_success", "on_failure", "on_preflight_failure"):
            if getattr(teardown, key) == "stop" and not t.errors.named(t.key(key)):
                default = "" if key in t.data else " (the default)"
                t.bad(key, f"'stop'{default} is not possible: {_NO_STOP[name]}")
    return teardown


def _load_staging(
    t: Table, data_check: DataCheckSection, path: Callable[[str, str], Path]
) -> DatasetSection:
    """The ``[dataset]`` table's staging keys (``repo`` and ``file`` required)."""
    d = DatasetSection(repo="", file="")
    repo = t.req_str("repo")
    if repo is not None:
        problem = repo_id_problem(repo)
        if problem:
            t.bad("repo", f"{show(repo)} is not a Hub repo id: {problem}")
    file = t.req_str("file")
    if file is not None:
        with t.errors.catch():
            check_inside("dataset.file", file, "the dataset repo")
    revision = t.str_("revision", d.revision) or d.revision
    with t.errors.catch():
        check_revision("dataset.revision", revision)
    data_yaml = t.str_("data_yaml", d.data_yaml)
    if data_yaml is not None:
        with t.errors.catch():
            check_inside("dataset.data_yaml", data_yaml, "dataset.dest")
    return DatasetSection(
        repo=repo or "",
        file=file or "",
        revision=revision,
        dest=path(t.str_("dest") or str(d.dest), "dataset.dest"),
        doctor=data_check.doctor,
        data_yaml=data_yaml,
    )


def _load_train(
    raw: object, dataset: DatasetSection | None, base: Path, errors: ErrorList
) -> TrainSection:
    defaults = TrainSection()
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        errors.add(ConfigError("train", f"{show(raw)} must be a table ([train])"))
        return defaults
    args: list[tuple[str, TrainValue]] = []
    stop_grace = defaults.stop_grace_s
    kill_grace = defaults.kill_grace_s
    for k, v in raw.items():
        key = f"train.{k}"
        if k in ("stop_grace", "kill_grace"):
            with errors.catch():
                seconds = parse_duration(key, v)
                if k == "stop_grace":
                    stop_grace = seconds
                else:
                    kill_grace = seconds
            continue
        if k in RESERVED_TRAIN_KEYS:
            errors.add(
                ConfigError(
                    key,
                    "is set by the agent; use job.name / job.runs_dir instead"
                    if k != "json"
                    else "is set by the agent (it always reads LibreYOLO's json result)",
                )
            )
        elif k in _NON_TRAINING_KEYS:
            errors.add(
                ConfigError(
                    key, f"{_NON_TRAINING_KEYS[k]}; the agent would read that as a finished run"
                )
            )
        elif not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            errors.add(ConfigError(key, "is not a valid LibreYOLO option name"))
        elif isinstance(v, bool | int | str) or (isinstance(v, float) and math.isfinite(v)):
            if isinstance(v, str):
                try:
                    refuse_unprintable(key, v, lax=True)
                except ConfigError as exc:
                    errors.add(exc)
                    continue
            if k in _PATH_TRAIN_KEYS and isinstance(v, str) and not Path(v).is_absolute():
                # The trainer runs in runs_dir: a file beside the job file is made absolute,
                # while names LibreYOLO resolves itself ("coco8.yaml", "yolox-n") stay as given.
                with contextlib.suppress(OSError, RuntimeError, ValueError):
                    if (base / v).exists():
                        v = str(base / v)
            args.append((k, v))
        else:
            errors.add(ConfigError(key, f"{show(v)} must be a string, number or boolean"))
    if not any(k == "data" for k, _ in args) and not errors.named("train.data"):
        if dataset is not None and dataset.data_yaml is not None:
            args.append(("data", str(dataset.dest / dataset.data_yaml)))
        elif not errors.named("dataset", "dataset.data_yaml"):
            errors.add(
                ConfigError(
                    "train.data",
                    "is required (the dataset YAML), or set dataset.data_yaml to take it from "
                    "the staged dataset",
                )
            )
    section = TrainSection(args=tuple(args), stop_grace_s=stop_grace, kill_grace_s=kill_grace)
    epochs = section.get("epochs")
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1
    ):
        errors.add(ConfigError("train.epochs", f"{show(epochs)} must be an integer >= 1"))
    return section


def check_train_options(train: TrainSection, options: TrainOptions) -> None:
    """Refuse every ``[train]`` key that the installed LibreYOLO's ``train`` command does not
    have, naming the closest valid ones (one :class:`ConfigError`, or :class:`ConfigErrors` for
    several); nothing to check (no error) when ``options`` are unknown, e.g. an agent-only
    install. The agent's own ``stop_grace``/``kill_grace`` never get here."""
    if not options.available:
        return
    errors = ErrorList()
    for k, v in train.args:
        if k in options.names:
            continue
        close = options.close_matches(k)
        hint = (
            f"did you mean {' or '.join(close)}?"
            if close
            else "`libreyolo train --help` lists them"
        )
        errors.add(
            ConfigError(
                f"train.{k}",
                f"unknown option (value {show(v)}): `libreyolo train` of {options.label} has no "
                f"{k!r}; {hint}",
            )
        )
    errors.raise_if_any()
