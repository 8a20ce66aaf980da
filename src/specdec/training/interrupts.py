"""Stopping cleanly: SIGINT/SIGTERM caught at a point where a command's state is whole (`InterruptGuard`,
`Interrupted`), and one writer per output folder (`folder_lock`). Used by `specdec data generate` and
`specdec train` (docs/architecture.md, "Failure model")."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import SpecdecError

LOCK_FILE = ".specdec-lock"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a command after it saved what had finished; `message` says what was kept."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or signal.Signals(signum).name)
        self.signum = signum
        self.message = message

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process the signal ended: 130, 143


class InterruptGuard:
    """While active (in the main thread), SIGINT and SIGTERM are caught instead of ending the process.

    The first signal is recorded; inside `interruptible()` it raises `Interrupted` at once (to stop a long
    computation whose result would be dropped anyway), elsewhere the owner polls `signum` or calls `check()`
    at a point where its state is whole. A second signal raises KeyboardInterrupt at once (files are written
    atomically, so even that leaves the last saved state intact).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.signum: int | None = None
        self._interruptible = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> InterruptGuard:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        if self._interruptible:
            self._interruptible = False
            raise Interrupted(signum)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        self.check()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)


@contextmanager
def folder_lock(folder: str | os.PathLike, command: str) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (a `.specdec-lock` file) for one writing command at a time; the
    operating system releases it when the process ends, however it ends."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no lock
        yield
        return
    handle = open(Path(folder) / LOCK_FILE, "a")  # held open as long as the lock
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SpecdecError(f"Another `specdec {command}` is writing into {folder}; wait for it to finish or "
                               "choose another --out.") from None
        yield
    finally:
        handle.close()
