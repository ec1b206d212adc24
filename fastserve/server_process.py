"""server.py as a subprocess on a free loopback port, its output in a log file: started, polled until /health
answers, stopped with SIGTERM (graceful shutdown) and SIGKILL if that takes too long.

Used by `fastserve compare` (fastserve/compare.py), `fastserve bench soak`, the live benchmarks and the tests that
need a real server (tests/server_fixtures.py, tests/test_loadgen.py), so that there is one way to run one. With no
model in its arguments server.py serves SmolLM2-135M-Instruct; with_model() gives a command's servers its own
default (the tiny model, for compare and soak).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

# server.py: beside the packages in a checkout, and in site-packages beside them when installed from the wheel
SERVER = Path(__file__).resolve().parents[1] / "server.py"


def with_model(args: Sequence[str], model: str) -> list[str]:
    """server.py's `args` with `--model MODEL` in front, unless they name a model themselves (--model or the
    positional MODEL): what a command that starts its own servers passes so that its default model is its own
    (compare and soak serve the tiny model; server.py alone serves SmolLM2)."""
    import server

    parser = server.build_parser()

    def refuse(message: str):
        raise ValueError(message)

    parser.error = refuse  # quietly: a bad flag is the server's to report when it starts
    try:
        given, _ = parser.parse_known_args(list(args))
    except ValueError:
        return list(args)
    return list(args) if given.model is not None or given.model_tag is not None else ["--model", model, *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python server.py --port P ARGS`, logging to LOG_DIR/server-NAME.log (NAME: the port by default);
    `command` runs another form of it (e.g. [".venv/bin/fastserve", "serve"]); `session`: in a process group of
    its own (as a terminal's foreground job: os.killpg(proc.pid, SIGINT) is a Ctrl-C); `cwd`: the folder it runs in
    (default: this process's)."""

    def __init__(self, args: Sequence[str], log_dir: Path, name: str | None = None,
                 env: Mapping[str, str] | None = None, command: Sequence[str] | None = None,
                 session: bool = False, cwd: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"server-{name or self.port}.log"
        command = [sys.executable, str(SERVER)] if command is None else list(command)
        cmd = [*command, "--port", str(self.port), *args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=None if env is None else dict(env), start_new_session=session)

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        """Poll /health until it answers 200; a one-line RuntimeError naming the log if the server exits or
        does not answer within `timeout` seconds (then it is stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:  # refused while starting; urllib's URLError and HTTPError (503) are OSErrors
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout:g} s; log: {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
