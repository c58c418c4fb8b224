"""Watching files: the one home of the agent's file-system notifications.

Two watchers, each for what it is needed for:

- :class:`RunWatcher` (watchdog, the project's watcher): the runs directory turned into an
  ``asyncio.Event``, so the daemon reacts to status.json and weights/ when they change, not on
  a polling tick. Its mask leaves IN_MODIFY out (:func:`_no_modify_events`).
- :class:`Inotify` (a raw inotify descriptor through libc): for the checkpoint follower
  (:mod:`agent.sync.follow`), which copies ``weights/*.pt`` while ``torch.save`` rewrites it in
  place. That needs what watchdog does not give: every IN_MODIFY of a file written in thousands
  of write() calls (watchdog's pipeline would make each one a Python event object on its
  observer thread), IN_CLOSE_WRITE to know the copy is whole, IN_Q_OVERFLOW to know events were
  lost, and a descriptor the follower reads itself, at once, when the engine claims a snapshot
  ("every write up to now is known"); a watchdog queue has no such point in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import struct
from pathlib import Path
from typing import Any

# inotify(7) event bits (linux/inotify.h); the standard library has no names for them.
IN_MODIFY = 0x2
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_ISDIR = 0x40000000
#: struct inotify_event without its name: wd, mask, cookie, len.
_EVENT = struct.Struct("iIII")


class RunWatcher:
    """inotify (watchdog) on the runs directory, turned into an ``asyncio.Event``: the agent
    reacts to status.json and weights/ changes when they happen, not on a polling tick."""

    def __init__(self, loop: asyncio.AbstractEventLoop, changed: asyncio.Event) -> None:
        from watchdog.observers import Observer

        self._loop = loop
        self._changed = changed
        self._observer = Observer()
        self._observer.daemon = True
        self._watched: set[Path] = set()
        self._started = False

    def watch(self, path: Path) -> None:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler

        if path in self._watched:
            return
        loop, changed = self._loop, self._changed

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if event.event_type in ("opened", "closed_no_write"):
                    return
                # Called from the observer thread: hand over to the loop thread-safely.
                with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                    loop.call_soon_threadsafe(changed.set)

        path.mkdir(parents=True, exist_ok=True)
        self._observer.schedule(_Handler(), str(path), recursive=True, **_no_modify_events())
        self._watched.add(path)
        if not self._started:
            self._observer.start()
            self._started = True

    def stop(self) -> None:
        if self._started:
            # Unschedule first: stopping with live watches logs spurious emitter errors.
            self._observer.unschedule_all()
            self._observer.stop()
            self._observer.join(timeout=5)
            self._started = False


def _no_modify_events() -> dict[str, Any]:
    """An inotify mask without IN_MODIFY: a trainer's ``torch.save`` of a 200 MB checkpoint is
    thousands of write() calls, each an event through watchdog's Python pipeline and a wake-up
    of the loop. The agent needs to know when a file is whole (IN_CLOSE_WRITE), created, moved
    or deleted; log growth is read on the loop's poll. ``event_filter`` is watchdog >= 4's way
    to set the mask; without it, every event is delivered as before."""
    import inspect

    from watchdog import events as ev
    from watchdog.observers.api import BaseObserver

    if "event_filter" not in inspect.signature(BaseObserver.schedule).parameters:
        return {}
    return {
        "event_filter": [
            ev.FileClosedEvent,
            ev.FileCreatedEvent,
            ev.DirCreatedEvent,
            ev.FileMovedEvent,
            ev.DirMovedEvent,
            ev.FileDeletedEvent,
            ev.DirDeletedEvent,
        ]
    }


class Inotify:
    """A non-blocking inotify descriptor (libc through ctypes: the standard library has none),
    read by its owner when it chooses: events come back as (watch, mask, name) tuples."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)  # IN_NONBLOCK, IN_CLOEXEC
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.fd: int = fd

    def add(self, path: Path, mask: int) -> int:
        """Watch ``path`` for the events in ``mask``; the watch descriptor. Raises OSError
        (out of watches, a missing path)."""
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
        return int(wd)

    def read(self) -> list[tuple[int, int, str]]:
        """The events waiting, as (watch, mask, name); [] when none."""
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        events = []
        at = 0
        while at + _EVENT.size <= len(data):
            wd, mask, _, n = _EVENT.unpack_from(data, at)
            raw = data[at + _EVENT.size : at + _EVENT.size + n].rstrip(b"\0")
            events.append((wd, mask, os.fsdecode(raw)))
            at += _EVENT.size + n
        return events

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
