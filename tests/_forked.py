"""Run a function in a forked child process of the test (real process, real signals, no re-import cost)."""

import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable


def run_forked(work: Callable[[], int], timeout: float = 120) -> tuple[int, str]:
    """Fork; the child runs ``work()`` with stdout and stderr sent to a pipe and exits with its return value
    (``SystemExit`` codes as given, other exceptions: 99 with their traceback). Returns ``(status, output)``,
    the status negative for a signal as in ``subprocess`` (``-9`` after SIGKILL)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            os.close(read_fd)
            stream = os.fdopen(write_fd, "w", buffering=1)
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
            sys.stdout = sys.stderr = stream
            code = work()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
            finally:
                os._exit(code if isinstance(code, int) else 0)
    os.close(write_fd)
    chunks, deadline = [], time.monotonic() + timeout
    with os.fdopen(read_fd, "rb", buffering=0) as reader:
        while True:
            ready, _, _ = select.select([reader], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:  # a hung child fails the test instead of blocking the suite
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise TimeoutError(f"forked child still running after {timeout} s")
            chunk = reader.read(65536)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return code, b"".join(chunks).decode(errors="replace")


def kill_at(step: tuple[str, int], hooks: dict[str, tuple[object, str]]) -> dict[str, int]:
    """In a child: wrap each ``hooks[name] = (owner, attribute)`` function so that the process SIGKILLs itself just
    before the ``step[1]``-th call of ``step[0]``; returns the call counts (kept up to date)."""
    counts = dict.fromkeys(hooks, 0)
    for name, (owner, attribute) in hooks.items():
        original = getattr(owner, attribute)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            if (_name, counts[_name]) == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return _original(*args, **kwargs)

        setattr(owner, attribute, wrapper)
    return counts
