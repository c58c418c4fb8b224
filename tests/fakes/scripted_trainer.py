"""A fast scripted stand-in for ``libreyolo train``: a real process that writes the same run
directory as LibreYOLO 1.6.0 on a schedule given as ``key=value`` arguments.

What it copies from the real trainer (``libreyolo/training/artifacts.py`` and
``libreyolo/cli/commands/train.py``):

- ``status.json`` is replaced atomically (temp file + rename) at train start, at each epoch end, at
  train end and on an exception; ``state`` is ``running``, ``completed`` or ``failed`` and a failure
  carries ``error: {type, message}`` (and, like the real one, no ``completed_epochs``).
- ``weights/last.pt`` every epoch, ``best.pt`` on improvement, ``epoch_N.pt`` every ``save_period``
  epochs: real zip archives written in place, *before* that epoch's status.json.
- ``metrics.jsonl`` gets one row per epoch.
- SIGINT stops it cleanly: status ``failed`` with error type ``KeyboardInterrupt``, exit 130. There
  is no SIGTERM handler, so SIGTERM kills it and status.json keeps saying ``running``.
- With ``name=run1`` taken, the run dir becomes ``run12`` (no separator), like ``exist_ok=false``.
- One JSON result object on stdout, like ``json=true``.

Arguments (all optional; unknown keys such as ``model=`` or ``data=`` are accepted and ignored):
``epochs`` (3), ``epoch_s`` seconds per epoch (0.05), ``save_period`` (0 = off), ``fail_at`` epoch
that raises (0 = never), ``exit_code`` of that failure (1), ``error`` message of that failure,
``error_type`` (RuntimeError), ``ignore_sigint``, ``ignore_sigterm`` (false), ``child`` (false:
start a helper process in its own session, like the multi-GPU coordinator, and write its pid to
``RUN/child.pid``), ``ckpt_kb`` checkpoint payload size (4), ``project`` (runs), ``name``
(train), ``exist_ok`` (false; true: reuse ``project/name`` as is), ``resume`` with
``model=RUN/weights/last.pt`` (true: go on from the epoch stored in that checkpoint, in the same
run dir with ``exist_ok``; like LibreYOLO, exit
2 when nothing is left to train, exit 4 when the checkpoint cannot be read, and the train-end
status.json counts only this invocation's epochs), ``hang_at`` epoch at whose start it stops making
progress but stays alive (0 = never), ``fail_once_at`` epoch that fails only when the run dir has no
``.failed_once`` marker yet (a transient crash), ``log_every_s`` (0 = off: print a progress line
to stderr, the trainer log, this often during an epoch, like tqdm's bar), ``hang_after_complete``
(false; true: write the completed status.json and the result, then stay alive forever: a trainer
hung at exit), ``pause_at`` epoch at whose start it writes ``RUN/.paused`` and waits, alive and
without progress, until ``RUN/.go`` exists (0 = never; on every invocation, resumed ones too: a
test's deterministic "now" inside a run).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, str] = {
    "epochs": "3",
    "epoch_s": "0.05",
    "save_period": "0",
    "fail_at": "0",
    "exit_code": "1",
    "error": "boom",
    "error_type": "RuntimeError",
    "ignore_sigint": "false",
    "ignore_sigterm": "false",
    "child": "false",
    "ckpt_kb": "4",
    "project": "runs",
    "name": "train",
    "exist_ok": "false",
    "resume": "false",
    "model": "",
    "hang_at": "0",
    "fail_once_at": "0",
    "log_every_s": "0",
    "hang_after_complete": "false",
    "pause_at": "0",
}

SCRIPT = Path(__file__).resolve()


def parse_args(argv: list[str]) -> dict[str, str]:
    opts = dict(DEFAULTS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"scripted_trainer: expected key=value, got {arg!r}")
        opts[key] = value
    return opts


def truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def atomic_write_json(path: Path, value: dict[str, Any]) -> None:
    """Like LibreYOLO's ``_atomic_write_json``: temp file in the same folder, then rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_checkpoint(path: Path, epoch: int, *, payload_kb: int = 4) -> None:
    """A ``.pt``-shaped zip archive, written in place (not atomically), like torch.save."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = (f"epoch={epoch};".encode() * (payload_kb * 1024 // 8 + 1))[: payload_kb * 1024]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", json.dumps({"epoch": epoch}).encode())
        zf.writestr("archive/data/0", body)
        zf.writestr("archive/version", b"3\n")


def read_checkpoint_epoch(path: Path) -> int | None:
    try:
        with zipfile.ZipFile(path) as zf:
            return int(json.loads(zf.read("archive/data.pkl"))["epoch"])
    except (OSError, zipfile.BadZipFile, KeyError, ValueError):
        return None


def choose_save_dir(project: Path, name: str, *, exist_ok: bool = False) -> Path:
    """``exist_ok=false``: ``run1`` taken -> ``run12``, ``run13``... (no separator)."""
    candidate = project / name
    if exist_ok:
        candidate.mkdir(parents=True, exist_ok=True)
        return candidate
    n = 2
    while candidate.exists():
        candidate = project / f"{name}{n}"
        n += 1
    candidate.mkdir(parents=True)
    return candidate


def spawn_child(save_dir: Path) -> subprocess.Popen[bytes]:
    """A helper in a session of its own (LibreYOLO's DDP coordinator does this)."""
    code = "import time\nwhile True:\n    time.sleep(1)\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    atomic_write_text(save_dir / "child.pid", f"{proc.pid}\n")
    return proc


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    if truthy(opts["ignore_sigint"]):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if truthy(opts["ignore_sigterm"]):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    epochs = int(opts["epochs"])
    epoch_s = float(opts["epoch_s"])
    save_period = int(opts["save_period"])
    fail_at = int(opts["fail_at"])
    ckpt_kb = int(opts["ckpt_kb"])
    hang_at = int(opts["hang_at"])
    fail_once_at = int(opts["fail_once_at"])
    log_every_s = float(opts["log_every_s"])
    pause_at = int(opts["pause_at"])
    start_epoch = 1
    if truthy(opts["resume"]):
        trained = read_checkpoint_epoch(Path(opts["model"]))
        if trained is None:
            print(json.dumps({"error": "model_load_failed", "message": "cannot load"}), flush=True)
            return 4
        if trained >= epochs:
            msg = f"its run already trained {trained}/{epochs} epochs"
            print(json.dumps({"error": "config_type_error", "message": msg}), flush=True)
            return 2
        start_epoch = trained + 1
    save_dir = choose_save_dir(
        Path(opts["project"]).resolve(), opts["name"], exist_ok=truthy(opts["exist_ok"])
    )
    weights = save_dir / "weights"
    started = time.time()
    base: dict[str, Any] = {
        "schema_version": 1,
        "pid": os.getpid(),
        "model_family": "scripted",
        "model_size": "n",
        "task": "detect",
        "save_dir": str(save_dir),
        "total_epochs": epochs,
        "start_epoch": start_epoch,
        "started_at": now_iso(),
    }

    def write_status(**fields: Any) -> None:
        payload = dict(base)
        payload.update(fields)
        payload.setdefault("elapsed_seconds", round(time.time() - started, 3))
        total = payload.get("total_epochs") or 0
        done = payload.get("completed_epochs") or 0
        payload["progress"] = (done / total) if total else 0.0
        payload["updated_at"] = now_iso()
        atomic_write_json(save_dir / "status.json", payload)

    def result(data: dict[str, Any]) -> None:
        data["schema_version"] = 1
        print(json.dumps(data), flush=True)

    child = None
    epoch = 0
    best_metric: float | None = None
    best_epoch: int | None = None
    try:
        if start_epoch == 1:
            (save_dir / "metrics.jsonl").unlink(missing_ok=True)
        write_status(state="running", completed_epochs=start_epoch - 1, current_epoch=None)
        if truthy(opts["child"]):
            child = spawn_child(save_dir)
        for epoch in range(start_epoch, epochs + 1):
            if epoch == hang_at:
                while True:  # alive, no progress: a hung collective, a stuck data loader
                    time.sleep(1)
            if epoch == pause_at:
                atomic_write_text(save_dir / ".paused", f"{epoch}\n")
                while not (save_dir / ".go").exists():
                    time.sleep(0.02)
            if epoch == fail_once_at and not (save_dir / ".failed_once").exists():
                (save_dir / ".failed_once").write_text("x")
                raise RuntimeError(opts["error"])
            deadline = time.monotonic() + epoch_s
            next_log = time.monotonic() + log_every_s
            while (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, 0.02))
                if log_every_s > 0 and time.monotonic() >= next_log:
                    next_log += log_every_s
                    done = 1 - max(0.0, deadline - time.monotonic()) / epoch_s
                    print(f"epoch {epoch}/{epochs}: {done:4.0%}", file=sys.stderr, flush=True)
            if epoch == fail_at:
                raise RuntimeError(opts["error"])
            metric = round(0.1 + 0.8 * (1 - 1 / (epoch + 1)), 4)
            is_best = best_metric is None or metric > best_metric
            write_checkpoint(weights / "last.pt", epoch, payload_kb=ckpt_kb)
            if is_best:
                best_metric, best_epoch = metric, epoch
                write_checkpoint(weights / "best.pt", epoch, payload_kb=ckpt_kb)
            if save_period and epoch % save_period == 0:
                write_checkpoint(weights / f"epoch_{epoch}.pt", epoch, payload_kb=ckpt_kb)
            row = {
                "epoch": epoch,
                "time": epoch_s,
                "train/loss": round(1.0 / epoch, 4),
                "validated": True,
                "is_best": is_best,
                "current_metric": metric,
                "current_metric_name": "mAP50_95",
                "best_metric": best_metric,
                "best_metric_name": "mAP50_95",
                "best_epoch": best_epoch,
            }
            with open(save_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            write_status(
                state="running",
                current_epoch=epoch,
                completed_epochs=epoch,
                epoch_seconds=epoch_s,
                mean_epoch_seconds=epoch_s,
                eta_seconds=epoch_s * (epochs - epoch),
                train_loss=row["train/loss"],
                metrics={"mAP50_95": metric},
                validated=True,
                current_metric=metric,
                current_metric_name="mAP50_95",
                best_metric=best_metric,
                best_metric_name="mAP50_95",
                best_epoch=best_epoch,
            )
    except KeyboardInterrupt as exc:
        write_status(
            state="failed",
            current_epoch=epoch,
            error={"type": "KeyboardInterrupt", "message": str(exc)},
        )
        return 130
    except RuntimeError as exc:
        err_type = opts["error_type"]
        write_status(
            state="failed",
            current_epoch=epoch,
            error={"type": err_type, "message": str(exc)},
        )
        code = int(opts["exit_code"])
        error = "cuda_oom" if "out of memory" in str(exc).lower() else "training_error"
        result({"error": error, "message": f"Training failed: {exc}", "suggestion": None})
        return code
    finally:
        if child is not None and child.poll() is None:
            # Like a coordinator that has lost track of its ranks: the child is left running.
            child.returncode = 0  # keep Popen's destructor from warning about a running child
    write_status(
        state="completed",
        completed_epochs=epochs - start_epoch + 1,  # LibreYOLO 1.6.0: this invocation's only
        total_seconds=round(time.time() - started, 3),
        best_metric=best_metric,
        best_epoch=best_epoch,
        checkpoints={"best": str(weights / "best.pt"), "last": str(weights / "last.pt")},
    )
    result(
        {
            "status": "complete",
            "model": "scripted",
            "epochs_completed": epochs,
            "best_epoch": best_epoch,
            "best_weights": str(weights / "best.pt"),
            "last_weights": str(weights / "last.pt"),
            "save_dir": str(save_dir),
        }
    )
    if truthy(opts["hang_after_complete"]):
        while True:  # trained and said so, but never exits (a worker that is never joined)
            time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
