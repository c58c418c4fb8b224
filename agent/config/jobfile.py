"""The job file (TOML) read and checked into a :class:`~agent.config.model.Job`: ``load_job`` (a
path), ``parse_job`` (TOML text), ``job_from_dict`` (a parsed document), a ``_load_*`` function
for the sections that need more than a table of values, and the checks across sections (budget
and price, provider and stop actions). The ``[train]`` table, LibreYOLO's own options, is read
by :mod:`agent.config.train`.

Every error names the key, the value and what was expected, so that ``libreyolo-agent check``
can print one line per mistake and exit 2; every mistake of a file is reported at once
(:class:`~agent.config.jobvalues.ConfigErrors`). Unknown keys are errors: a typo must never be
silently ignored on a box that bills by the hour. The checks of single values live in
:mod:`agent.config.jobvalues`; the defaults live once, in the dataclasses of
:mod:`agent.config.model`.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast, get_args
from urllib.parse import urlsplit

from agent.config.jobvalues import (
    MAX_STEERING_S,
    ConfigError,
    ErrorList,
    Table,
    check_api_url,
    check_document,
    check_inside,
    check_revision,
    check_sync_target,
    huge_integer_problem,
    instance_id_problem,
    parse_listen,
    repo_id_problem,
    show,
)
from agent.config.model import (
    DEFAULT_LISTEN,
    NOTIFY_EVENTS,
    DataCheckSection,
    DatasetSection,
    Job,
    JobSection,
    LimitsSection,
    NotifySection,
    PreemptionSection,
    PreflightSection,
    ProfileAction,
    ProfileSection,
    ProviderName,
    ServerSection,
    SuccessAction,
    SyncSection,
    TeardownAction,
    TeardownSection,
    as_action,
)
from agent.config.train import check_train_options, load_train
from agent.install.libreyolo import TrainOptions, installed_train_options

#: A job file is a few hundred bytes; refuse to read a huge one (or /dev/zero) into memory.
MAX_JOB_FILE_BYTES = 1 << 20
#: ``[dataset]`` keys that stage a Hub dataset; without any of them the table only sets checks.
_STAGING_KEYS = ("repo", "file", "revision", "dest", "data_yaml")
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
_SUCCESS_ACTIONS: tuple[SuccessAction, ...] = get_args(SuccessAction)
_SECTIONS = (
    "job",
    "train",
    "dataset",
    "sync",
    "limits",
    "teardown",
    "server",
    "preflight",
    "preemption",
    "notify",
    "profile",
)
#: ``[profile] on_verdict`` values.
_PROFILE_ACTIONS: tuple[ProfileAction, ...] = get_args(ProfileAction)


def teardown_provider(doc: Mapping[str, Any]) -> str:
    """The provider a raw job document names (for cross-section checks)."""
    td = doc.get("teardown")
    value = td.get("provider", "none") if isinstance(td, dict) else "none"
    return value if isinstance(value, str) else "none"


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


def _unknown_section(name: str) -> ConfigError:
    """``trian: unknown section; did you mean [train]? (expected one of: ...)``: the closest
    section names, as a misspelt ``[train]`` option gets its closest options."""
    import difflib

    close = difflib.get_close_matches(name.lower(), _SECTIONS, n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(f'[{c}]' for c in close)}?" if close else ""
    return ConfigError(
        name or repr(name),
        f"unknown section{hint} (expected one of: {', '.join(_SECTIONS)})",
    )


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
        errors.add(_unknown_section(name))

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
            doctor_first=t.bool_("doctor_first", data_check.doctor_first),
            allow_outside_paths=t.bool_("allow_outside_paths", data_check.allow_outside_paths),
        )
        if any(k in t.data for k in _STAGING_KEYS):
            dataset = _load_staging(t, data_check, path)
        else:
            t.used.update(_STAGING_KEYS)  # listed as expected keys in an unknown key's message
        t.finish()

    train = load_train(doc.get("train"), dataset, base, errors)
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
        max_restarts=t.int_("max_restarts", d_limits.max_restarts, minimum=0),
        restart_backoff_s=t.duration(
            "restart_backoff", d_limits.restart_backoff_s, allow_zero=True
        ),
        stall_epoch_factor=t.number("stall_epoch_factor", d_limits.stall_epoch_factor, minimum=1.0)
        or d_limits.stall_epoch_factor,
        first_epoch_timeout_s=t.duration("first_epoch_timeout", d_limits.first_epoch_timeout_s),
        finish_reserve_s=t.duration("finish_reserve", d_limits.finish_reserve_s),
        exit_grace_s=t.duration("exit_grace", d_limits.exit_grace_s),
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
        warm_start=t.bool_("warm_start", d_pre.warm_start),
    )
    t.finish()

    preemption = _load_preemption(Table("preemption", doc.get("preemption", {}), errors))

    notify = _load_notify(Table("notify", doc["notify"], errors)) if "notify" in doc else None

    profile = _load_profile(Table("profile", doc.get("profile", {}), errors))

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
        preemption=preemption,
        notify=notify,
        profile=profile,
        source=source,
    )


def _auto_bool(t: Table, k: str) -> bool | None:
    """``true``, ``false`` or ``"auto"`` (the default: None, detect)."""
    v = t.data.get(k) if isinstance(t.data, dict) else None
    t.used.add(k)
    if v is None or v == "auto":
        return None
    if not isinstance(v, bool):
        t.bad(k, f'{show(v)} must be true, false or "auto"')
        return None
    return v


def _load_preemption(t: Table) -> PreemptionSection:
    """The ``[preemption]`` table: which spot notices to watch, and where."""
    d = PreemptionSection()
    urls: dict[str, str] = {}
    for key, default in (("aws_url", d.aws_url), ("gcp_url", d.gcp_url)):
        url = t.str_(key, default) or default
        if url != default:
            with t.errors.catch():
                url = check_api_url(t.key(key), url)
        urls[key] = url
    section = PreemptionSection(
        aws=_auto_bool(t, "aws"),
        gcp=_auto_bool(t, "gcp"),
        sigterm=t.bool_("sigterm", d.sigterm),
        aws_url=urls["aws_url"],
        gcp_url=urls["gcp_url"],
        poll_interval_s=t.duration("poll_interval", d.poll_interval_s),
    )
    t.finish()
    return section


def _load_profile(t: Table) -> ProfileSection:
    """The ``[profile]`` table: the profiler pre-run and what a wrong-size verdict does."""
    d = ProfileSection()
    on_verdict = t.choice("on_verdict", d.on_verdict, _PROFILE_ACTIONS)
    section = ProfileSection(
        enabled=t.bool_("enabled", d.enabled),
        steps=t.int_("steps", d.steps, minimum=1),
        warmup=t.int_("warmup", d.warmup, minimum=0),
        timeout_s=t.duration("timeout", d.timeout_s),
        on_verdict="stop" if on_verdict == "stop" else "warn",
    )
    t.finish()
    return section


def _load_notify(t: Table) -> NotifySection | None:
    """The ``[notify]`` table: a webhook URL (a secret: messages show its host only), which
    events it is sent, and how often per-epoch notices go out."""
    d = NotifySection(webhook="")
    if t.errors.named("notify"):  # not a table: already said, nothing more to read
        return None
    webhook = _webhook(t)
    every_epochs = t.int_("every_epochs", d.every_epochs, minimum=0)
    events = d.events
    raw = t.data.get("events")
    t.used.add("events")
    if raw is not None:
        events = _notify_events(t, raw, every_epochs)
    timeout_s = t.duration("timeout", d.timeout_s)
    t.finish()
    if webhook is None:
        return None
    return NotifySection(
        webhook=webhook, events=events, every_epochs=every_epochs, timeout_s=timeout_s
    )


def _webhook(t: Table) -> str | None:
    """``notify.webhook``: an http(s) URL with a host. Credentials and tokens in it are allowed
    (Slack and Discord webhooks carry theirs in the path), so no message ever echoes it."""
    t.used.add("webhook")
    if "webhook" not in t.data:
        t.bad("webhook", "is required but missing (the http:// or https:// URL to POST to)")
        return None
    url = t.data["webhook"]
    if not isinstance(url, str):
        t.bad("webhook", f"a {type(url).__name__} is not a URL (a string)")
        return None
    for i, ch in enumerate(url):
        if not ch.isprintable() or ch.isspace():
            t.bad("webhook", f"contains a space or an unprintable character at position {i}")
            return None
    if not url:
        t.bad("webhook", "must not be empty")
        return None
    shown = NotifySection(webhook=url).shown
    try:
        parsed = urlsplit(url)
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        t.bad("webhook", f"{shown} is not a valid URL")
        return None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        t.bad("webhook", f"{shown} must be an http:// or https:// URL with a host")
        return None
    if parsed.fragment or url.endswith("#"):
        t.bad("webhook", f"{shown} must not have a #fragment (it is never sent)")
        return None
    return url


def _notify_events(t: Table, raw: object, every_epochs: int) -> tuple[str, ...]:
    """``notify.events``: a list of event kinds, each one of :data:`NOTIFY_EVENTS`."""
    valid = ", ".join(NOTIFY_EVENTS)
    if not isinstance(raw, list) or not all(isinstance(k, str) for k in raw):
        t.bad("events", f"{show(raw)} must be a list of event names, some of: {valid}")
        return NotifySection(webhook="").events
    chosen = tuple(dict.fromkeys(k for k in raw if k in NOTIFY_EVENTS))
    unknown = [k for k in raw if k not in NOTIFY_EVENTS]
    if "epoch" in unknown:
        t.bad("events", "'epoch' notices are chosen with notify.every_epochs = N, not here")
    elif unknown:
        names = ", ".join(show(k) for k in unknown)
        t.bad("events", f"unknown event {names} (expected some of: {valid})")
    elif not raw and every_epochs == 0:
        t.bad(
            "events",
            "[] selects nothing to send (and every_epochs is 0): list some of "
            f"{valid}, or remove [notify]",
        )
    return chosen


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
        on_success=cast(SuccessAction, t.choice("on_success", d.on_success, _SUCCESS_ACTIONS)),
        on_failure=as_action(t.choice("on_failure", d.on_failure, _ACTIONS)),
        on_preflight_failure=as_action(
            t.choice("on_preflight_failure", d.on_preflight_failure, _ACTIONS)
        ),
        require_verified_sync=t.bool_("require_verified_sync", d.require_verified_sync),
        require_restore_drill=t.bool_("require_restore_drill", d.require_restore_drill),
        restore_drill_timeout_s=t.duration("restore_drill_timeout", d.restore_drill_timeout_s),
        expected_gap_s=t.duration("expected_gap", None, allow_zero=True),
        api_url=api_url,
        instance_id=instance_id,
        command=command if name == "command" else (),
        stop_command=stop_command if name == "command" else (),
        command_timeout_s=timeout_s,
        hold_timeout_s=t.duration("hold_timeout", d.hold_timeout_s, maximum=MAX_STEERING_S),
    )
    t.finish()
    if teardown.on_success == "auto" and teardown.expected_gap_s is None:
        if not t.errors.named(t.key("expected_gap")):
            t.bad("expected_gap", 'is required with on_success = "auto" (e.g. "8h")')
    elif teardown.expected_gap_s is not None and teardown.on_success != "auto":
        t.bad(
            "expected_gap", f'is only used by on_success = "auto" (it is {teardown.on_success!r})'
        )
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
