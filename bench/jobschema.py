"""The job schema: the hand-written one (agent/config/model.py, jobfile.py, train.py, jobvalues.py)
measured against pydantic v2 (issue 27, "the job schema from a well-kept library where it
serves"). Results and the verdict: docs/benchmarks.md, "The job schema: hand-written vs
pydantic".

    .venv/bin/python bench/jobschema.py [--repeat 5] [--loops 2000]

Four figures, printed; nothing is asserted and nothing of the agent changes:

(a) errors: the same bad job files through both, side by side (every mistake at once? the key,
    the value, what was expected, "did you mean"?). Ours is ``parse_job``'s ``ConfigError`` /
    ``ConfigErrors``; pydantic's is ``ValidationError.errors()``, one line each as
    ``loc: msg (input ...)``, the least a CLI would print.
(b) import cost: a fresh interpreter (a subprocess each, ``--repeat`` times, medians) after
    ``import agent.config.jobfile`` and after ``import pydantic`` + building the model below:
    VmRSS (``/proc/self/status``), Pss and Pss_Anon (``/proc/self/smaps_rollup``; Pss_Anon is
    what no other process shares) and the import's wall time.
(c) parse time of the demo job (agent/demo.py's text): TOML to a checked job, per parse.
(d) a JSON Schema for editors: pydantic's ``model_json_schema()``, and what ours would need.

The pydantic model is a fair copy of the job schema's [job], [train], [sync], [limits],
[teardown], [server] and [preflight] tables: their real types, bounds, durations, defaults,
cross-key rules, extra keys forbidden; [dataset], [preemption], [notify] and [profile] are taken
as plain tables (not modelled). It lives in :func:`pydantic_model` so that this module imports
only the standard library: without pydantic the bench says so and exits 0.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: The [train] options the bad files are checked against (a fixed list, so the figures do not
#: depend on the LibreYOLO installed): what ``installed_train_options()`` reads from LibreYOLO.
TRAIN_NAMES = frozenset(
    {"data", "model", "epochs", "imgsz", "batch", "workers", "device", "pretrained", "lr0"}
    | {"save_period", "patience", "optimizer", "seed", "amp", "resume"}
)
RESERVED = {"project", "name", "json"}
NON_TRAINING = {"dry_run", "help_json"}

#: The demo job (agent/demo.py), with its folders under /srv/demo.
DEMO_JOB = """
[job]
name = "demo"
runs_dir = "/srv/demo/runs"

[train]
model = "yolox-n"
pretrained = false
data = "/srv/demo/data/data.yaml"
epochs = 3
imgsz = 64
batch = 4
workers = 0
save_period = 1

[sync]
target = "file:///srv/demo/synced"
every_epochs = 1

[preflight]
allow_cpu = true

[teardown]
provider = "none"

[server]
listen = "127.0.0.1:8421"
"""

_DATA = '[train]\ndata = "/data/set/data.yaml"\n'
#: The bad job files of tests/test_jobfile.py's kinds: each name says what is wrong.
BAD_JOBS: dict[str, str] = {
    "three independent mistakes": _DATA
    + '[sync]\ntarget = "file:///mnt/backup"\nevery_epochs = 0\n'
    + '[limits]\nmax_runtime = "12x"\n[teardown]\non_success = "explode"\n',
    "unknown sections and keys": _DATA
    + '[limits]\nmax_run_time = "1h"\nbudget = 5\n[trian]\nepochs = 1\n'
    + '[alerts]\nwebhook = "x"\n',
    "misspelt [train] options": _DATA + "epoch = 1\nsave_perod = 2\nname = 'x'\n",
    "wrong types": _DATA
    + 'epochs = "ten"\n[sync]\ntarget = "file:///mnt/b"\nprivate = "yes"\n'
    + "[preflight]\nallow_cpu = 1\n[limits]\nmax_restarts = -1\n",
    "missing required keys": "[train]\nepochs = 3\n[sync]\nevery_epochs = 2\n",
    "bad values": _DATA
    + '[sync]\ntarget = "s3://bucket/run"\n[limits]\nstall_timeout = -1\n'
    + '[teardown]\nhold_timeout = "90d"\n[server]\nlisten = "localhost"\n',
    "rules across keys": _DATA
    + '[limits]\nbudget_usd = 5\n[teardown]\nprovider = "lambda"\napi_url = "ftp://x"\n',
}


# --------------------------------------------------------------------------------- ours


def ours_errors(text: str) -> list[str]:
    from agent.config.jobfile import parse_job
    from agent.config.model import ConfigError
    from agent.install.libreyolo import TrainOptions

    options = TrainOptions(names=TRAIN_NAMES, version="(bench)")
    try:
        parse_job(text, source="job.toml", train_options=options)
    except ConfigError as exc:
        return [str(one) for one in exc.errors]
    return []


# ----------------------------------------------------------------------------- pydantic


def _duration(maximum: float = 365 * 86400.0, allow_zero: bool = False) -> Any:
    """A before-validator: ``"12h"``, ``"1h30m"`` or seconds, as ours (jobvalues.parse_duration)."""
    expected = 'a duration like "90s", "20m", "12h", "1h30m", "2d" or a number of seconds'

    def parse(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"{value!r} is not {expected}")
        if isinstance(value, str):
            text, seconds, pos = value.strip().lower(), 0.0, 0
            for m in re.finditer(r"(\d+(?:\.\d+)?)(d|h|m|s)", text):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * {"d": 86400, "h": 3600, "m": 60, "s": 1}[m[2]]
                pos = m.end()
            if not text or pos != len(text):
                raise ValueError(f"{value!r} is not {expected}")
        else:
            seconds = float(value)
        if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
            raise ValueError(f"{value!r} must be a positive duration ({expected})")
        if seconds > maximum:
            raise ValueError(f"{value!r} is more than {maximum / 86400:g}d, the longest allowed")
        return seconds

    return parse


def _train_key(key: str, info: Any) -> str:
    """A [train] key: not one the agent sets, a LibreYOLO option (``context["names"]``)."""
    if key in RESERVED:
        raise ValueError("is set by the agent; use job.name / job.runs_dir instead")
    if key in NON_TRAINING:
        raise ValueError("exits without training; the agent would read that as a finished run")
    names = (info.context or {}).get("names")
    if names and key not in names:
        close = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}?" if close else "see `libreyolo train --help`"
        raise ValueError(f"unknown option {key!r}; {hint}")
    return key


def _sync_target(value: str) -> str:
    if value.startswith("file:///") and "?" not in value and "#" not in value:
        return value
    if re.fullmatch(r"hf://[\w.-]+/[\w.-]+/?", value):
        return value
    raise ValueError(f"{value!r} must start with file:/// or hf://")


def _listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not host:port (e.g. '127.0.0.1:8421', '[::1]:8421')")
    return value


def _plain_name(value: str) -> str:
    if "/" in value or value in (".", ".."):
        raise ValueError(f"{value!r} must be a plain name, not a path")
    if len(value.encode()) > 200:
        raise ValueError("is longer than 200 bytes")
    return value


def pydantic_model() -> Any:
    """The job schema as pydantic models (built here: pydantic is imported by this call)."""
    from typing import Annotated, Literal

    from pydantic import (
        AfterValidator,
        BaseModel,
        BeforeValidator,
        ConfigDict,
        Field,
        StrictBool,
        StrictFloat,
        StrictInt,
        StrictStr,
        ValidationInfo,
        model_validator,
    )

    Text = Annotated[StrictStr, Field(min_length=1, pattern=r"^[^\x00-\x1f\x7f]*$")]

    # json_schema_input_type: without it the schema says "number" and an editor would flag
    # every "12h" of a correct job file.
    def duration(**kw: Any) -> Any:
        return BeforeValidator(_duration(**kw), json_schema_input_type=str | float)

    Duration = Annotated[float, duration()]
    Money = Annotated[float, Field(gt=0, allow_inf_nan=False)]
    Action = Literal["destroy", "stop", "keep"]
    Argv = Annotated[list[Text], Field(min_length=1)]

    def train_key(key: str, info: ValidationInfo) -> str:
        return _train_key(key, info)

    class Table(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    class JobT(Table):
        name: Annotated[Text, AfterValidator(_plain_name)] = "run1"
        runs_dir: Text = "runs"
        stop_trainer_on_exit: StrictBool = False

    class TrainT(Table):
        model_config = ConfigDict(extra="allow", strict=True, frozen=True)
        __pydantic_extra__: dict[
            Annotated[str, Field(pattern=r"^[A-Za-z_]\w*$"), AfterValidator(train_key)],
            StrictBool | StrictInt | StrictFloat | Text,
        ]
        data: Text | None = None
        epochs: Annotated[StrictInt, Field(ge=1)] | None = None
        stop_grace: Duration = 60.0
        kill_grace: Duration = 10.0

    class SyncT(Table):
        target: Annotated[Text, AfterValidator(_sync_target)]
        every_epochs: Annotated[StrictInt, Field(ge=1)] = 1
        private: StrictBool = True
        upload_timeout: Duration = 600.0
        max_backoff: Duration = 300.0
        finish_timeout: Duration = 1800.0

    class LimitsT(Table):
        max_runtime: Duration | None = None
        stall_timeout: Duration | None = None
        budget_usd: Money | None = None
        price_usd_per_hour: (
            Annotated[float, Field(ge=0, allow_inf_nan=False)] | Literal["auto"] | None
        ) = None
        max_price_usd_per_hour: Money | None = None
        storage_usd_per_gb_month: Annotated[float, Field(ge=0)] | None = None
        max_restarts: Annotated[StrictInt, Field(ge=0)] = 3
        restart_backoff: Annotated[float, duration(allow_zero=True)] = 10.0
        stall_epoch_factor: Annotated[float, Field(ge=1)] = 3.0
        first_epoch_timeout: Duration | None = None
        finish_reserve: Duration | None = None
        exit_grace: Duration = 120.0

        @model_validator(mode="after")
        def _price(self) -> LimitsT:
            if self.budget_usd is not None and not self.price_usd_per_hour:
                raise ValueError("budget_usd needs price_usd_per_hour > 0 (or 'auto')")
            if self.max_price_usd_per_hour is not None and self.price_usd_per_hour is None:
                raise ValueError("max_price_usd_per_hour needs price_usd_per_hour")
            return self

    class TeardownT(Table):
        provider: Literal["vast", "runpod", "lambda", "command", "none"] = "none"
        on_success: Action = "destroy"
        on_failure: Action = "stop"
        on_preflight_failure: Action = "destroy"
        require_verified_sync: StrictBool = True
        api_url: Annotated[Text, Field(pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")] | None = None
        instance_id: Text | None = None
        command: Argv | None = None
        stop_command: Argv | None = None
        command_timeout: Duration = 300.0
        hold_timeout: Annotated[float, duration(maximum=30 * 86400.0)] = 43200.0

        @model_validator(mode="after")
        def _provider(self) -> TeardownT:
            api = self.provider in ("vast", "runpod", "lambda")
            if (self.api_url or self.instance_id) and not api:
                raise ValueError(f"api_url/instance_id are not used by {self.provider!r}")
            if (self.command or self.stop_command) and self.provider != "command":
                raise ValueError("command/stop_command are only used by provider 'command'")
            if self.provider == "command" and not self.command:
                raise ValueError('command is required with provider "command"')
            no_stop = self.provider == "lambda" or (
                self.provider == "command" and not self.stop_command
            )
            for key in ("on_success", "on_failure", "on_preflight_failure"):
                if no_stop and getattr(self, key) == "stop":
                    raise ValueError(f"{key}: 'stop' is not possible with {self.provider!r}")
            return self

    class ServerT(Table):
        listen: Annotated[Text, AfterValidator(_listen)] = "127.0.0.1:8421"
        allow_remote: StrictBool = False

    class PreflightT(Table):
        enabled: StrictBool = True
        allow_cpu: StrictBool = False
        timeout: Duration = 120.0
        deep_import: StrictBool = False
        warm_start: StrictBool = True

    class Job(Table):
        job: JobT = JobT()
        train: TrainT = TrainT()
        sync: SyncT | None = None
        limits: LimitsT = LimitsT()
        teardown: TeardownT = TeardownT()
        server: ServerT = ServerT()
        preflight: PreflightT = PreflightT()
        dataset: dict[str, Any] | None = None  # not modelled here
        preemption: dict[str, Any] | None = None  # not modelled here
        notify: dict[str, Any] | None = None  # not modelled here
        profile: dict[str, Any] | None = None  # not modelled here

        @model_validator(mode="after")
        def _across(self) -> Job:
            if self.train.data is None and not (self.dataset or {}).get("data_yaml"):
                raise ValueError("train.data is required (or dataset.data_yaml)")
            auto = self.limits.price_usd_per_hour == "auto"
            if auto and self.teardown.provider in ("none", "command"):
                raise ValueError("limits.price_usd_per_hour = 'auto' needs an API provider")
            return self

    return Job


def pydantic_errors(model: Any, text: str) -> list[str]:
    from pydantic import ValidationError

    try:
        model.model_validate(tomllib.loads(text), context={"names": TRAIN_NAMES})
    except ValidationError as exc:
        lines = []
        for e in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in e["loc"]) or "(job)"
            shown = repr(e["input"])
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            lines.append(f"{loc}: {e['msg']} (input {shown})")
        return lines
    return []


# ---------------------------------------------------------------------------- the figures

_PROBE = """
import json, sys, time
sys.path.insert(0, {repo!r})
t0 = time.perf_counter()
{body}
took = time.perf_counter() - t0
status = open("/proc/self/status").read()
rollup = open("/proc/self/smaps_rollup").read()
def kib(text, key):
    return int(text.split(key + ":")[1].split()[0])
print(json.dumps({{"rss": kib(status, "VmRSS"), "pss": kib(rollup, "Pss"),
    "pss_anon": kib(rollup, "Pss_Anon"), "s": took, "modules": len(sys.modules),
    "pydantic": "pydantic" in sys.modules}}))
"""

PROBES = {
    "bare python": "pass",
    "agent.config.jobfile": "import tomllib, agent.config.jobfile",
    "pydantic + the model": "import tomllib, bench.jobschema as b; b.pydantic_model()",
    # What ``libreyolo-agent run`` imports: the CLI (which reads the job with ours) and the daemon.
    "the agent (cli + daemon)": "import agent.cli, agent.daemon.spine",
    "the agent + pydantic + the model": (
        "import agent.cli, agent.daemon.spine, bench.jobschema as b; b.pydantic_model()"
    ),
}


def probe(body: str, repeat: int) -> dict[str, float] | str:
    rows = []
    for _ in range(repeat):
        code = _PROBE.format(repo=str(REPO), body=body)
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False
        )
        if proc.returncode != 0:
            return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:100]
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    # Memory: the median; the import's time: the best (the machine may be busy).
    got = {k: statistics.median(float(r[k]) for r in rows) for k in rows[0]}
    got["s"] = min(float(r["s"]) for r in rows)
    return got


def per_parse_us(fn: Any, loops: int) -> float:
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e6


def show_errors(model: Any) -> None:
    print("(a) errors for the same bad job files: ours | pydantic (one line per error)")
    for name, text in BAD_JOBS.items():
        ours, theirs = ours_errors(text), pydantic_errors(model, text)
        print(f"\n  -- {name}: ours {len(ours)} error(s), pydantic {len(theirs)}")
        for line in ours:
            print(f"     ours      {line}")
        for line in theirs:
            print(f"     pydantic  {line}")


def show_memory(repeat: int) -> None:
    print(f"\n(b) import cost, fresh interpreter, median of {repeat} (MiB; s: best import time)")
    rows: dict[str, dict[str, float]] = {}
    for name, body in PROBES.items():
        got = probe(body, repeat)
        if isinstance(got, str):
            print(f"  {name:34} {got}")
            continue
        rows[name] = got
        print(
            f"  {name:34} RSS {got['rss'] / 1024:5.1f}  PSS {got['pss'] / 1024:5.1f}  "
            f"Pss_Anon {got['pss_anon'] / 1024:5.1f}  {got['s']:.3f}s  "
            f"{got['modules']:.0f} modules" + ("  [pydantic loaded]" if got["pydantic"] else "")
        )

    def delta(a: str, b: str, what: str) -> None:
        if a in rows and b in rows:
            d = {k: (rows[a][k] - rows[b][k]) / 1024 for k in ("rss", "pss", "pss_anon")}
            s = rows[a]["s"] - rows[b]["s"]
            print(
                f"  {what}: RSS {d['rss']:+.1f}, PSS {d['pss']:+.1f}, Pss_Anon "
                f"{d['pss_anon']:+.1f} MiB, {s:+.3f}s"
            )

    delta("agent.config.jobfile", "bare python", "ours over bare python")
    delta("pydantic + the model", "bare python", "pydantic + the model over bare python")
    delta("the agent + pydantic + the model", "the agent (cli + daemon)", "in the agent")


def show_parse_time(model: Any, loops: int) -> None:
    from agent.config.jobfile import parse_job

    root = Path("/srv/demo")
    ours = per_parse_us(lambda: parse_job(DEMO_JOB, source="<demo>", base_dir=root), loops)
    theirs = per_parse_us(lambda: model.model_validate(tomllib.loads(DEMO_JOB)), loops)
    toml = per_parse_us(lambda: tomllib.loads(DEMO_JOB), loops)
    doc = tomllib.loads(DEMO_JOB)
    validate = per_parse_us(lambda: model.model_validate(doc), loops)
    print(f"\n(c) parse time of the demo job, TOML included, best of 5 x {loops} (us per parse)")
    print(f"  ours (parse_job)          {ours:7.1f}")
    print(f"  pydantic (model_validate) {theirs:7.1f}   of which tomllib {toml:.1f}")
    print(f"  validation alone: ours {ours - toml:.1f}, pydantic {validate:.1f}")
    t0 = time.perf_counter()
    pydantic_model()
    print(
        f"  building the pydantic model once (at import): {(time.perf_counter() - t0) * 1e3:.1f} ms"
    )


def show_json_schema(model: Any) -> None:
    schema = model.model_json_schema()
    text = json.dumps(schema, indent=2)
    defs = schema.get("$defs", {})
    closed = sum(1 for d in defs.values() if d.get("additionalProperties") is False)
    print("\n(d) JSON Schema for editors")
    print(
        f"  pydantic: model_json_schema() -> {len(text)} bytes, {len(defs)} tables "
        f"({closed} closed: additionalProperties false), "
        f"{sum(len(d.get('properties', {})) for d in defs.values())} keys with types, "
        "bounds, enums and defaults"
    )
    limits = defs.get("LimitsT", {}).get("properties", {})
    print(f"  e.g. limits.max_runtime: {json.dumps(limits.get('max_runtime'))}")
    print(
        "  not in it: what validators check (durations' syntax, sync.target's schemes, the rules "
        "across keys, [train] options): an editor flags types, enums, bounds and unknown keys"
    )
    print(
        "  ours: none today; a schema would be generated from the dataclasses of config/model.py "
        "(fields, defaults, Literal enums, the #: comments as descriptions) plus the key names "
        "and bounds that live in jobfile.py's reader calls, kept in step by a test"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="subprocesses per memory figure")
    parser.add_argument("--loops", type=int, default=2000, help="parses per timing round")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("pydantic") is None:
        print("pydantic not installed: nothing to compare (pip install pydantic to run this)")
        return 0
    import pydantic

    model = pydantic_model()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"pydantic {pydantic.VERSION}, Python {sys.version.split()[0]}, load average {load}\n")
    show_errors(model)
    show_memory(args.repeat)
    show_parse_time(model, args.loops)
    show_json_schema(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
