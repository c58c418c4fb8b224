"""LibreYOLO's train options, read from its source: right names, never an import of torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.install.libreyolo import TrainOptions, installed_train_options, read_train_options

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALLED = installed_train_options()
requires_libreyolo = pytest.mark.skipif(
    not INSTALLED.available, reason=f"needs LibreYOLO's train options: {INSTALLED.reason}"
)

SOURCE = textwrap.dedent(
    """
    import typer
    from typing import Optional

    def helper(epochs_wrong=1): ...

    def train_cmd(
        source,
        data: str = typer.Option(..., help="dataset"),
        model: str = typer.Option("yolox-s"),
        epochs: int = typer.Option(300),
        batch: int = 16,
        imgsz: str = typer.Option("640"),
        device: str = typer.Option("auto"),
        amp: bool = typer.Option(True),
        single_cls: bool = typer.Option(False, "--single-cls/--no-single-cls"),
        cuda_graph: bool = typer.Option(False, "--cuda-graph", help="one way"),
        json_output: bool = typer.Option(False, "--json"),
        quiet: bool = typer.Option(False, "--quiet", "-q"),
        target: str = typer.Argument(...),
        *,
        save_period: Optional[int] = typer.Option(None),
    ) -> None:
        pass
    """
)


def test_options_follow_typers_naming_rules() -> None:
    options = read_train_options(SOURCE, version="9.9")
    assert options.available and options.label == "LibreYOLO 9.9"
    assert options.names == {
        "data",
        "model",
        "epochs",
        "batch",  # a plain default is an option too
        "imgsz",
        "device",
        "amp",
        "no_amp",  # a bool without flags gets --amp/--no-amp
        "single_cls",
        "no_single_cls",
        "cuda_graph",  # a one-way flag: no negative form
        "json",  # the flag's name, not the parameter's
        "quiet",
        "save_period",
    }


def test_close_matches_are_best_first() -> None:
    options = read_train_options(SOURCE)
    assert options.close_matches("epoch") == ["epochs"]
    assert options.close_matches("save_perod")[0] == "save_period"
    assert options.close_matches("zzzz") == []


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("def train_cmd(:\n", "cannot parse"),
        ("x = \x00\n", "cannot parse"),
        ("def other(data=1, model=1, epochs=1, batch=1, imgsz=1, device=1): ...\n", "no train_cmd"),
        ("def train_cmd(data=1, model=1): ...\n", "does not declare batch, device, epochs, imgsz"),
    ],
)
def test_unexpected_source_gives_a_reason_not_a_list(source: str, reason: str) -> None:
    options = read_train_options(source)
    assert not options.available and options.names == frozenset()
    assert options.reason is not None and reason in options.reason


@requires_libreyolo
def test_installed_libreyolo_options() -> None:
    names = INSTALLED.names
    used_by_agent = {"model", "pretrained", "data", "epochs", "imgsz", "batch", "workers"}
    assert used_by_agent | {"device", "save_period", "resume", "lr0", "exist_ok"} <= names
    assert {"json", "project", "name", "no_amp", "mosaic"} <= names
    assert "json_output" not in names and "epoch" not in names
    assert installed_train_options() is INSTALLED  # read once per process


@requires_libreyolo
def test_reading_the_options_imports_neither_torch_nor_libreyolo() -> None:
    script = (
        "import json, sys\n"
        "from agent.install.libreyolo import installed_train_options\n"
        "o = installed_train_options()\n"
        "mods = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'libreyolo'))\n"
        "print(json.dumps({'n': len(o.names), 'mods': mods}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mods"] == [] and out["n"] == len(INSTALLED.names)


@requires_libreyolo
def test_options_match_what_libreyolos_cli_accepts() -> None:
    # The real command, built the way LibreYOLO's entry point builds it (this imports torch:
    # seconds). Every --flag (and --no-flag) it accepts must be a key, and nothing more.
    script = (
        "import json, typer, typer.main\n"
        "from libreyolo.cli.commands.train import train_cmd\n"
        "from libreyolo.cli.parsing import KeyValueCommand\n"
        "app = typer.Typer(add_completion=False)\n"
        "app.command(cls=KeyValueCommand)(train_cmd)\n"
        "cmd = typer.main.get_command(app)\n"
        "keys = {o[2:].replace('-', '_') for p in cmd.params\n"
        "        for o in [*p.opts, *getattr(p, 'secondary_opts', [])] if o.startswith('--')}\n"
        "print(json.dumps(sorted(keys)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(json.loads(proc.stdout.strip().splitlines()[-1])) == INSTALLED.names


def test_a_libreyolo_of_another_layout_is_not_checked(tmp_path: Path) -> None:
    # A LibreYOLO without cli/commands/train.py: `check` must not refuse a job for that.
    (tmp_path / "libreyolo").mkdir()
    (tmp_path / "libreyolo" / "__init__.py").write_text("raise SystemExit('imported!')\n")
    job = tmp_path / "job.toml"
    job.write_text('[train]\ndata = "/d.yaml"\nepoch = 1\n', encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", "check", str(job)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(tmp_path),
            "LIBREYOLO_AGENT_STATE_DIR": str(tmp_path / "state"),
        },
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "not checked" in proc.stdout and "cannot read" in proc.stdout
    assert "imported!" not in proc.stderr


def test_unavailable_options_say_why() -> None:
    options = TrainOptions(reason="libreyolo is not installed for this Python")
    assert not options.available and options.close_matches("epoch") == []


# ---- types -------------------------------------------------------------------------------------


def test_types_come_from_the_annotations_and_the_options_bounds() -> None:
    source = textwrap.dedent(
        """
        import typer
        from typing import Optional

        def train_cmd(
            data: str = typer.Option(...),
            model: str = typer.Option("yolox-s"),
            epochs: int = typer.Option(300),
            batch: int = 16,
            imgsz: str = typer.Option("640"),
            device: str = typer.Option("auto"),
            amp: bool = typer.Option(True),
            cls_pw: float = typer.Option(0.0, min=0.0, max=1.0),
            lr: Optional[float] = typer.Option(None, min=-1),
            keep: int | None = typer.Option(None),
            paths: list[str] = typer.Option([]),
        ) -> None:
            pass
        """
    )
    options = read_train_options(source)
    types = options.types
    assert {k: t.kind for k, t in types.items()} == {
        "data": "str",
        "model": "str",
        "epochs": "int",
        "batch": "int",
        "imgsz": "str",
        "device": "str",
        "amp": "bool",
        "no_amp": "bool",
        "cls_pw": "float",
        "lr": "float",
        "keep": "int",
    }  # a list is not understood, so not checked
    assert (types["cls_pw"].minimum, types["cls_pw"].maximum) == (0.0, 1.0)
    assert (types["lr"].minimum, types["lr"].maximum) == (-1.0, None)
    assert types["batch"].default == 16 and types["data"].default is None
    assert options.value_problem("paths", 5) is None
    assert options.value_problem("keep", "x") == (
        "'x' is not an integer: `libreyolo train` of LibreYOLO takes an integer"
    )
    assert options.value_problem("lr", -2) == (
        "-2 is out of range: `libreyolo train` of LibreYOLO takes a number of at least -1"
    )


#: (key, TOML value) pairs, each checked here and by LibreYOLO's own parser.
TYPED_VALUES: list[tuple[str, object]] = [
    ("batch", 16),
    ("batch", "16"),
    ("batch", "big"),
    ("batch", 16.0),
    ("batch", 16.5),
    ("batch", True),
    ("batch", "1_6"),
    ("batch", "-1"),
    ("workers", "2.5"),
    ("lr0", "abc"),
    ("lr0", "1e-3"),
    ("lr0", 1),
    ("lr0", False),
    ("amp", True),
    ("amp", False),
    ("amp", "TRUE"),
    ("amp", "yes"),
    ("amp", 1),
    ("amp", 2),
    ("single_cls", "0"),
    ("cls_pw", 2),
    ("cls_pw", 0.5),
    ("cls_pw", "-0.1"),
    ("imgsz", 640),
    ("device", 0),
    ("aux_weight", "x"),
    ("aux_weight", 0.25),
    ("eval_max_det", "10"),
]


@requires_libreyolo
def test_type_verdicts_match_what_libreyolos_cli_parses() -> None:
    # LibreYOLO's real command parses each value (parsing only: nothing trains; this imports
    # torch: seconds). The check must refuse exactly what it refuses.
    from agent.trainer.process import _fmt

    argvs = [f"{k}={_fmt(v)}" for k, v in TYPED_VALUES]  # type: ignore[arg-type]
    script = (
        "import json, sys, typer, typer.main\n"
        "from libreyolo.cli.commands.train import train_cmd\n"
        "from libreyolo.cli.parsing import KeyValueCommand\n"
        "app = typer.Typer(add_completion=False)\n"
        "app.command(cls=KeyValueCommand)(train_cmd)\n"
        "cmd = typer.main.get_command(app)\n"
        "out = []\n"
        "for arg in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        cmd.make_context('train', ['data=d.yaml', arg])\n"
        "        out.append(None)\n"
        "    except Exception as exc:\n"
        "        out.append(type(exc).__name__)\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = json.loads(proc.stdout.strip().splitlines()[-1])
    theirs = {arg: why is not None for arg, why in zip(argvs, refused, strict=True)}
    ours = {
        f"{k}={_fmt(v)}": INSTALLED.value_problem(k, v) is not None  # type: ignore[arg-type]
        for k, v in TYPED_VALUES
    }
    assert ours == theirs
    assert sum(theirs.values()) >= 8  # the list really holds refused values
