"""What stands behind an engine process's pipe, beyond the pipe itself: a child this server spawned
(`OwnedChild`: closing the pipe ends it) or a shared engine the `--processes` parent spawned (`SharedChild`:
closing leaves it to the other server processes)."""

from __future__ import annotations

import multiprocessing.process
import os
import signal
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Protocol

from server.processes.engine_child import CLOSE_TIMEOUT_S
from server.processes.engine_messages import Close


class ChildLink(Protocol):
    """How a server reaches the process behind an engine's pipe beyond the pipe itself."""

    @property
    def pid(self) -> int | None: ...

    def kill(self) -> None: ...

    def close(self, conn: Connection) -> None: ...

    def describe_exit(self) -> str: ...


class OwnedChild:
    """An engine process this server spawned: closing the pipe ends it."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def kill(self) -> None:
        self._process.kill()

    def close(self, conn: Connection) -> None:
        close_child(conn, self._process)

    def describe_exit(self) -> str:
        return exit_description(self._process)


class SharedChild:
    """A shared engine the `--processes` parent spawned: closing the pipe leaves it to the others; a
    hung one is killed by its pid, and the parent, seeing it go, starts it again."""

    def __init__(self, pid: int) -> None:
        self._pid = pid

    @property
    def pid(self) -> int | None:
        return self._pid

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.kill(self._pid, signal.SIGKILL)

    def close(self, conn: Connection) -> None:
        with suppress(OSError):
            conn.send(Close())
        conn.close()

    def describe_exit(self) -> str:
        return "the shared engine process closed its socket"


def close_child(conn: Connection, process: multiprocessing.process.BaseProcess) -> None:
    """Tell the child to stop, wait for it, kill it if it does not exit; close the pipe."""
    with suppress(OSError):  # already gone
        conn.send(Close())
    process.join(CLOSE_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def exit_description(process: multiprocessing.process.BaseProcess) -> str:
    process.join(0.5)
    code = process.exitcode
    if code is None:
        return "still running, its pipe closed"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"
