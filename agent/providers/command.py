"""The ``command`` provider: any other cloud, through a command of the job's.

``teardown.command`` (destroy) and ``teardown.stop_command`` (stop) are argv lists run without a
shell, in their own session, stdin closed, with ``LIBREYOLO_TEARDOWN_ACTION`` and
``LIBREYOLO_TEARDOWN_REASON`` added to the agent's environment (``HF_TOKEN`` left out); after
``teardown.command_timeout`` the whole process group gets SIGTERM, then SIGKILL. Examples:
``["shutdown", "-h", "now"]`` on EC2 with InstanceInitiatedShutdownBehavior=terminate,
``["gcloud", "compute", "instances", "delete", "NAME", "--zone", "ZONE", "--quiet"]``.

A command cannot be read back: **its own exit status 0 is the confirmation**, and every result
says so ("not read back"). Its output (stdout and stderr, the last 64 KiB kept, every secret of
the environment redacted, cut to one line) is part of the result.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from typing import IO

from agent.config.model import Env, TeardownAction, TeardownSection
from agent.providers import (
    STOP_NOTE,
    Identity,
    OnSent,
    ProviderError,
    TeardownResult,
    finished,
    redact,
)
from agent.util.procs import stop_group

log = logging.getLogger(__name__)

#: Bytes of output kept (the tail: where a command says why it failed).
OUTPUT_KEEP_BYTES = 64 * 1024
#: Characters of output in a result's one-line detail.
OUTPUT_DETAIL_CHARS = 400
NOT_READ_BACK = "not read back: a command provider cannot read back"


class CommandProvider:
    name = "command"

    def __init__(self, cfg: TeardownSection, env: Env, *, kill_grace_s: float = 5.0) -> None:
        self.cfg = cfg
        self.secrets = env.secrets()
        self.timeout_s = cfg.command_timeout_s
        #: Seconds between SIGTERM and SIGKILL of a command past its timeout.
        self.kill_grace_s = kill_grace_s

    @property
    def can_stop(self) -> bool:
        return bool(self.cfg.stop_command)

    def _argv(self, action: TeardownAction) -> tuple[str, ...]:
        return self.cfg.command if action == "destroy" else self.cfg.stop_command

    async def identify(self) -> Identity:
        """Checks the commands can be started (found and executable); runs nothing."""
        if not self.cfg.command:
            raise ProviderError("config", "command: teardown.command is not set")
        for key, argv in (
            ("teardown.command", self.cfg.command),
            ("teardown.stop_command", self.cfg.stop_command),
        ):
            if argv and _executable(argv[0]) is None:
                raise ProviderError(
                    "config",
                    f"command: {key}: {argv[0]!r} is not an executable file or not on PATH",
                )
        detail = f"command: would run {self._show(self.cfg.command)} to destroy" + (
            f", {self._show(self.cfg.stop_command)} to stop" if self.cfg.stop_command else ""
        )
        return Identity(self.name, None, "teardown.command", None, detail)

    async def price_usd_per_hour(self) -> float | None:
        return None

    async def teardown(
        self, action: TeardownAction, reason: str, *, on_sent: OnSent | None = None
    ) -> TeardownResult:
        if action == "keep":
            detail = f"command: keep: nothing run, the box stays up (reason {reason})"
            return finished("keep", False, True, detail)
        argv = self._argv(action)
        if not argv:
            detail = (
                f"command: no teardown.{'command' if action == 'destroy' else 'stop_command'} "
                f"to {action} with: nothing was run; the box is KEPT and still bills"
            )
            return finished(action, False, False, detail)
        shown = self._show(argv)
        # Output goes to an unlinked file, not a pipe: asyncio's wait() also waits for every
        # pipe to close, and a child the command leaves running (`shutdown` schedules one) would
        # hold it open.
        with tempfile.TemporaryFile() as sink:
            ran = await self._run(argv, shown, action, reason, sink, on_sent)
            if isinstance(ran, TeardownResult):
                return ran
            code, timed_out = ran
            output = _tail(sink)
        tail = self._clean(output.decode("utf-8", "replace"), keep_tail=True)
        said = f"; output: {tail}" if tail else "; no output"
        if timed_out:
            detail = (
                f"command: {action}: {shown} timed out after {self.timeout_s:g}s and was killed "
                f"(exit {code}){said}; NOT confirmed ({NOT_READ_BACK})"
            )
            return finished(action, True, False, detail)
        if code == 0:
            detail = (
                f"command: {action}: {shown} exited 0, confirmed by its own success "
                f"({NOT_READ_BACK}){said}" + (f"; {STOP_NOTE}" if action == "stop" else "")
            )
            return finished(action, True, True, detail)
        detail = f"command: {action}: {shown} failed with exit {code}{said}; NOT confirmed"
        return finished(action, True, False, detail)

    async def _run(
        self,
        argv: tuple[str, ...],
        shown: str,
        action: TeardownAction,
        reason: str,
        sink: IO[bytes],
        on_sent: OnSent | None,
    ) -> TeardownResult | tuple[int | None, bool]:
        """Run ``argv`` to its end or its timeout: ``(exit status, timed out)``, or the result
        when it could not start."""
        # Everything the agent has (the cloud tool's credentials) but the Hub token: a teardown
        # command has no business with the checkpoints' repository.
        env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
        env["LIBREYOLO_TEARDOWN_ACTION"] = action
        env["LIBREYOLO_TEARDOWN_REASON"] = reason
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=sink,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        except (OSError, ValueError) as exc:
            detail = self._clean(f"command: {action}: cannot start {shown}: {exc}")
            return finished(action, False, False, detail)
        log.info("teardown: command %s started: %s (pid %d)", action, shown, proc.pid)
        if on_sent is not None:
            try:
                on_sent(f"started {shown} (pid {proc.pid})")
            except Exception:
                log.exception("teardown: recording 'sent' failed; waiting for the command anyway")
        try:
            return await asyncio.wait_for(proc.wait(), self.timeout_s), False
        except TimeoutError:
            return await stop_group(proc, grace_s=self.kill_grace_s), True

    async def confirm(self, action: TeardownAction) -> TeardownResult:
        if action == "keep":
            return TeardownResult("keep", False, True, "command: keep: nothing to read back")
        return TeardownResult(action, True, False, f"command: {action}: {NOT_READ_BACK}")

    async def read_back(self, action: TeardownAction) -> TeardownResult | None:
        # Nothing can be read back: a restarted agent runs the command again.
        return None

    def _show(self, argv: tuple[str, ...]) -> str:
        return self._clean(" ".join(argv), limit=200)

    def _clean(
        self, text: str, *, limit: int = OUTPUT_DETAIL_CHARS, keep_tail: bool = False
    ) -> str:
        line = " ".join(redact(text, self.secrets).split())
        if len(line) <= limit:
            return line
        return "..." + line[-(limit - 3) :] if keep_tail else line[: limit - 3] + "..."


def _tail(f: IO[bytes]) -> bytes:
    """The last :data:`OUTPUT_KEEP_BYTES` written to ``f``."""
    try:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - OUTPUT_KEEP_BYTES))
        return f.read(OUTPUT_KEEP_BYTES)
    except OSError as exc:
        return f"(output unreadable: {exc})".encode()


def _executable(program: str) -> str | None:
    if "/" in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program)
