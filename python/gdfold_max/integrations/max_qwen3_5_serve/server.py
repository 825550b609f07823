"""A `max serve` process on localhost, for the example, the served tests and the served
benchmark: a free port, the process in a session of its own (so that stopping it stops
the model worker it spawns), and a wait for ``/health``, which answers only once the
model is built and compiled.

Waiting needs ``httpx`` (in MAX's serve extra).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: What MAX's ``max`` console script runs (its entry point in MAX 26.7), for a MAX
#: installed without its scripts on the way (``pip install --target``).
MAX_ENTRY = "import sys; from max._entrypoints.pipelines import main; sys.argv[0] = 'max'; sys.exit(main())"


def max_command() -> list[str]:
    """The command that runs MAX's CLI: the ``max`` script beside this Python, else the
    one on ``PATH``, else MAX's entry point run by this Python."""
    beside = Path(sys.executable).with_name("max")
    found = str(beside) if beside.exists() else shutil.which("max")
    return [found] if found else [sys.executable, "-c", MAX_ENTRY]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """``argv`` running with its output in ``log`` (the command line first), until the
    block ends: then SIGTERM, and SIGKILL to its process group if it has not exited in a
    minute."""
    with log.open("w") as stream:
        stream.write(" ".join(argv) + "\n")
        stream.flush()
        proc = subprocess.Popen(argv, stdout=stream, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)


async def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Returns once ``url``/health answers 200. Raises RuntimeError, with the end of
    ``log``, if the process exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"max serve exited {proc.returncode}; the end of {log}:\n{log.read_text()[-4000:]}")
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"max serve not ready after {timeout_s:.0f} s; see {log}")
            await asyncio.sleep(2)
