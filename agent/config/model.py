"""The job as one tree of frozen dataclasses, and the environment the agent reads.

The dataclasses hold every default once; reading and checking a job file into them is
:mod:`agent.config.jobfile`, the checks of single values :mod:`agent.config.jobvalues` (whose
:class:`ConfigError`, :class:`ConfigErrors` and duration helpers are re-exported here).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast, get_args
from urllib.parse import urlsplit

from agent.config.jobvalues import ConfigError as ConfigError
from agent.config.jobvalues import ConfigErrors as ConfigErrors
from agent.config.jobvalues import format_duration as format_duration
from agent.config.jobvalues import is_loopback, url_scheme
from agent.config.jobvalues import parse_duration as parse_duration
from agent.config.jobvalues import repo_id_problem as repo_id_problem

#: Default state directory (env ``LIBREYOLO_AGENT_STATE_DIR`` overrides it).
DEFAULT_STATE_DIR = Path("/var/lib/libreyolo-agent")
DEFAULT_HF_ENDPOINT = "https://huggingface.co"

TrainValue = str | int | float | bool

# --------------------------------------------------------------------------------------------
# Sections


#: What happens to the box at the end: ``destroy`` (billing ends, disk gone), ``stop`` (the
#: disk survives for cents an hour), ``keep`` (the box stays up).
TeardownAction = Literal["destroy", "stop", "keep"]
#: ``teardown.on_success``: an action, or ``auto``: stop or destroy, whichever this box's own
#: figures say is cheaper for ``teardown.expected_gap`` (:mod:`agent.policy.autoteardown`).
SuccessAction = Literal["destroy", "stop", "keep", "auto"]


#: Who carries out the teardown: a cloud provider's API (``vast``, ``runpod``, ``lambda``), a
#: command of the job's (``command``) or nobody (``none``: a dry run that records the action).
ProviderName = Literal["vast", "runpod", "lambda", "command", "none"]


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


#: Experiment loggers a job may ask for (``train.loggers``): LibreYOLO's built-in ones that the
#: agent keeps on one run across resumes (:mod:`agent.trainer.logged_entry`).
LoggerName = Literal["tensorboard", "mlflow", "wandb"]
LOGGER_NAMES: tuple[LoggerName, ...] = ("tensorboard", "mlflow", "wandb")


@dataclass(frozen=True)
class TrainSection:
    #: ``key=value`` arguments for ``libreyolo train`` in job-file order (``data`` is required).
    args: tuple[tuple[str, TrainValue], ...] = ()
    #: Seconds to wait after SIGINT (LibreYOLO's clean stop) before SIGTERM (``train.stop_grace``).
    stop_grace_s: float = 60.0
    #: Seconds to wait after SIGTERM before SIGKILL to the whole tree (``train.kill_grace``).
    kill_grace_s: float = 10.0
    #: Experiment loggers (``train.loggers``), each one run across the trainer's resumes; empty:
    #: none, and the trainer is the plain ``libreyolo train`` command.
    loggers: tuple[LoggerName, ...] = ()
    #: Read each epoch's ``last.pt`` for NaN/inf (``train.check_weights``; its bytes, without
    #: torch; the losses are watched either way): agent/daemon/diverge.py.
    check_weights: bool = True

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
    ``doctor``, ``doctor_first`` and ``allow_outside_paths``; a ``[dataset]`` table may hold
    only these three)."""

    #: Run ``libreyolo doctor`` on the job's data YAML; its errors stop the job (reason
    #: ``preflight_failed``). Default true; ``dataset.doctor = false`` opts out.
    doctor: bool = True
    #: Make the trainer wait for the doctor. Default false: the doctor (which imports torch,
    #: several billed seconds on a GPU box) runs beside the trainer's own start-up, and errors
    #: it finds stop the trainer the moment it reports them. True: no trainer starts (and no
    #: GPU time is spent) before the doctor has passed.
    doctor_first: bool = False
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
    #: Training counts as stalled when no progress signal (status.json, a checkpoint, the train
    #: log) moved for this long, seconds; the threshold grows to ``stall_epoch_factor x mean
    #: epoch time`` once epochs are timed (agent/watch/progress.py). Job file:
    #: ``limits.stall_timeout`` (a duration).
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
    #: Resume a trainer that died without a clean end (crash, SIGKILL, OOM-kill, reboot,
    #: preemption) from its own ``weights/last.pt`` at most this many times (``max_restarts``).
    max_restarts: int = 3
    #: Wait before the first resume, seconds; doubled for each further one, capped at 10 minutes
    #: (``restart_backoff``, a duration).
    restart_backoff_s: float = 10.0
    #: The stall threshold adapts to the run: ``max(stall_timeout, stall_epoch_factor x mean
    #: epoch time)`` once an epoch was timed (``stall_epoch_factor``).
    stall_epoch_factor: float = 3.0
    #: The first epoch's own allowance (data loading, compilation), seconds
    #: (``first_epoch_timeout``, a duration). Default None: 3 x ``stall_timeout``.
    first_epoch_timeout_s: float | None = None
    #: Time kept before ``max_runtime`` (and budget) for the final sync, seconds
    #: (``finish_reserve``, a duration). Default None: estimated from the observed upload speed
    #: and the checkpoints' sizes.
    finish_reserve_s: float | None = None
    #: Seconds a trainer whose status.json says completed may take to exit before it is killed
    #: as hung at exit (the run still counts as completed) (``exit_grace``, a duration).
    exit_grace_s: float = 120.0


@dataclass(frozen=True)
class TeardownSection:
    #: Who tears the box down: ``vast``, ``runpod``, ``lambda`` (their APIs, keys from the
    #: environment), ``command`` (``teardown.command``) or ``none`` (default: records the action
    #: it would take and does nothing).
    provider: ProviderName = "none"
    #: What to do with the box when training completed: ``destroy``, ``stop``, ``keep`` or
    #: ``auto`` (stop or destroy from this box's figures and ``expected_gap``).
    on_success: SuccessAction = "destroy"
    #: What to do after any other outcome (the box holds checkpoints: keep its disk).
    on_failure: TeardownAction = "stop"
    #: What to do when preflight (or staging) failed: nothing was trained, the box is bad.
    on_preflight_failure: TeardownAction = "destroy"
    #: Never destroy or stop the box unless every checkpoint upload was verified.
    require_verified_sync: bool = True
    #: Never destroy the box unless the final ``best.pt``/``last.pt``, fetched back from the
    #: sync target, loaded with LibreYOLO (the restore drill, :mod:`agent.sync.restore`): a
    #: drill that failed or timed out turns a destroy into a stop. Default true.
    require_restore_drill: bool = True
    #: Seconds the restore drill may take per file, download and load
    #: (``teardown.restore_drill_timeout``, a duration; default 15 minutes).
    restore_drill_timeout_s: float = 900.0
    #: ``on_success = "auto"``: how long until the next run on this box is expected, seconds
    #: (``teardown.expected_gap``, a duration, e.g. ``"8h"``); required with ``auto``.
    expected_gap_s: float | None = None
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
    #: How long ``libreyolo-agent hold`` keeps the box up after the run before the teardown goes
    #: ahead anyway, seconds (``teardown.hold_timeout``, a duration; default 12 hours).
    hold_timeout_s: float = 12 * 3600.0

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
    #: Run the torch probe in the trainer's own process, which then trains without importing
    #: torch again (agent/trainer/warm_entry.py): about 4 s less billed start-up on an H200 box.
    # Only
    #: for one training process on at most one GPU, with ``[profile]`` off; off starts cold.
    warm_start: bool = True


#: What a sizing verdict that says the box is the wrong size does (``[profile] on_verdict``):
#: ``warn`` logs it and trains on; ``stop`` ends the job before the long run.
ProfileAction = Literal["warn", "stop"]


@dataclass(frozen=True)
class ProfileSection:
    """``[profile]``: is this the right box? Before the long run, LibreYOLO's own profiler
    (``libreyolo profile run``) runs a few steps on the rented card with the job's model,
    batch, imgsz and workers (agent/watch/profiling.py); during the first epochs the agent judges
    the same from GPU and CPU samples anyway (agent/watch/sizing.py). Default: off."""

    #: Run the profiler before the long run (``enabled``; default false: it costs a minute or
    #: two of the box, and needs a weights file of the job's model, see agent/watch/profiling.py).
    enabled: bool = False
    #: Profiled (measured) steps (``steps``; default 20).
    steps: int = 20
    #: Warm-up steps before measuring (``warmup``; default 3).
    warmup: int = 3
    #: Seconds the whole profiler run may take before it is killed and the job goes on without
    #: its verdict (``timeout``, a duration; default 5 minutes).
    timeout_s: float = 300.0
    #: ``warn`` (default): a verdict that says the box is the wrong size (dataloader, host /
    #: launch bound, idle GPU) or a projection over ``limits.budget_usd`` is logged and shown;
    #: ``stop``: the job stops before the long run with that reason, and the teardown policy
    #: for a run that trained nothing worth keeping applies.
    on_verdict: ProfileAction = "warn"


#: The default metadata endpoints (a job sets others for tests and proxies).
AWS_METADATA_URL = "http://169.254.169.254"
GCP_METADATA_URL = "http://metadata.google.internal"


@dataclass(frozen=True)
class PreemptionSection:
    """Spot/preemptible notices (``[preemption]``). On a notice the agent uploads ``last.pt`` at
    once, stops the trainer cleanly, and ends with reason ``preempted``; the next boot resumes."""

    #: Watch the AWS IMDSv2 spot notice: True, False, or None (default) to detect an EC2 box
    #: (its DMI vendor) and watch only there (``aws = true | false | "auto"``).
    aws: bool | None = None
    #: Watch the GCP ``instance/preempted`` flag: True, False, or None (default) to detect a
    #: Compute Engine box (``gcp = true | false | "auto"``).
    gcp: bool | None = None
    #: A SIGTERM to the agent is a preemption notice (RunPod spot pods and container stops send
    #: one): the agent saves ``last.pt`` and stops the trainer instead of leaving it running.
    sigterm: bool = False
    #: Base URL of the AWS instance metadata service (``aws_url``).
    aws_url: str = AWS_METADATA_URL
    #: Base URL of the GCP metadata server (``gcp_url``).
    gcp_url: str = GCP_METADATA_URL
    #: Seconds between two polls of the metadata endpoints (``poll_interval``, a duration).
    poll_interval_s: float = 5.0


#: Event kinds (agent/events.py) a webhook can be sent, by ``[notify] events``. ``epoch`` is
#: not among them: per-epoch notices are chosen with ``[notify] every_epochs``.
NOTIFY_EVENTS = (
    "job_started",
    "phase",
    "training_started",
    "best",
    "upload",
    "warning",
    "stall",
    "resume",
    "preempted",
    "teardown",
    "teardown_sent",
    "teardown_confirmed",
    "failure",
    "done",
    "steering",
)
#: What a webhook is sent unless ``[notify] events`` says otherwise: what a sleeping person
#: wants to wake up to, not every phase change or upload.
DEFAULT_NOTIFY_EVENTS = (
    "job_started",
    "training_started",
    "best",
    "stall",
    "warning",
    "resume",
    "preempted",
    "teardown",
    "teardown_sent",
    "teardown_confirmed",
    "failure",
    "done",
)


@dataclass(frozen=True)
class NotifySection:
    """Webhook notices (``[notify]``), sent by :mod:`agent.status.notify`: a Slack- and
    Discord-compatible JSON body (``text``, ``content``) plus the structured event."""

    #: The http(s) URL the notices are POSTed to. Slack and Discord webhooks carry their secret
    #: in the path, so the whole URL is treated as a secret: never logged, never in ``repr``,
    #: shown as :attr:`shown` (``https://hooks.slack.com/...``).
    webhook: str = field(repr=False)
    #: Which event kinds are sent (a subset of :data:`NOTIFY_EVENTS`); default
    #: :data:`DEFAULT_NOTIFY_EVENTS`.
    events: tuple[str, ...] = DEFAULT_NOTIFY_EVENTS
    #: Also send a notice every N completed epochs (and at the last one); 0 (default): none.
    every_epochs: int = 0
    #: Seconds one POST may take before it counts as failed and is retried
    #: (``notify.timeout``, a duration; default 10 s).
    timeout_s: float = 10.0

    @property
    def shown(self) -> str:
        """The webhook as logs and messages may show it: scheme and host only."""
        try:
            parsed = urlsplit(self.webhook)
            host = parsed.hostname
        except ValueError:
            return "<webhook>"
        if not parsed.scheme or not host:
            return "<webhook>"
        host = f"[{host}]" if ":" in host else host
        return f"{parsed.scheme}://{host}/..."


#: Where a run's id comes from, first set wins: ours, then the launch engines' own, each
#: stable across the engine's relaunches of one run (SkyPilot's task id is the same on every
#: recovery of a managed job, sky/skylet/constants.py; dstack's runner sets the run's name).
RUN_ID_VARIABLES = ("LIBREYOLO_AGENT_RUN_ID", "SKYPILOT_TASK_ID", "DSTACK_RUN_NAME")


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
    #: The run's id where a launch engine names it, the same on every box it relaunches the
    #: job on (:data:`RUN_ID_VARIABLES`, first set wins); notices name the run by it.
    run_id: str | None = None
    #: The variable ``run_id`` came from.
    run_id_from: str | None = None

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

        run_id_from = next((n for n in RUN_ID_VARIABLES if value(n)), None)
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
            run_id=value(run_id_from) if run_id_from else None,
            run_id_from=run_id_from,
        )

    def run_name(self, job_name: str) -> str:
        """How notices name the run: the job's name, with the engine's run id when set."""
        return f"{job_name} [{self.run_id}]" if self.run_id else job_name

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
    preemption: PreemptionSection = PreemptionSection()
    #: Webhook notices, or None when the job has no ``[notify]`` table.
    notify: NotifySection | None = None
    #: Box sizing: the ``[profile]`` pre-run and what a wrong-size verdict does.
    profile: ProfileSection = ProfileSection()
    #: Where the job came from (a path, or ``<demo>``); for messages only.
    source: str = "<memory>"
