"""Encoder lives forked from one parent that imported everything once, for tests that kill a
worker many times: a cold `streamvqa encoder` spends about 8 s importing torch and transformers on
a 2-core CPU, a forked life is encoding within a fraction of a second. Each life runs the
service's real `main` (configuration from the SVQA_* environment, model load, Redis, store).

`python -m tests.lives` (`Lives` starts it) reads one JSON command a line and answers one line:

    {"start": {"log": LOG, "kill_at": KILL_AT, "env": {...}}}  ->  the life's pid; its output goes
        to LOG, KILL_AT (or null) arms common.faults, env is added to the parent's environment
    {"wait": PID}  ->  how it ended, as Popen.returncode says it: N, or -SIGNAL

The parent runs no thread of its own when it forks (torch's import leaves one idle native thread,
as in any process forking after it: DataLoader workers do the same), its intra-op pool is set to
one thread and has done no work, and its heap is frozen, so a child starts as cleanly as a fresh
process, single-threaded: on a shared 2-core machine that is what lets many short lives be fast.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import traceback
from pathlib import Path

START_S = 120.0  # the parent's imports on a loaded 2-core machine, with room


def _life(log: str, kill_at: str | None, env: dict[str, str]) -> int:
    """In the child: the encoder's main, its output to ``log``."""
    from common import faults
    from encoder_worker import service

    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.update(env)
    faults.arm(kill_at)
    try:
        return service.main(["streamvqa encoder"])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1


def _build_model_once(name: str, device: str) -> None:
    """The model is built here, once, too (0.2-0.4 s a life): a random model's build is seeded, so
    every build gives these weights. Each life's `main` gets them from `load_model` and makes its
    runtime from its own copy (on write) of them."""
    from common.engine import model

    built, build = model.load_model(name, device=device), model.load_model

    def load_model(name_: str, **kw):
        plain = {"device": device, "gemm_dtype": "bf16"}  # what every life asks for
        return built if name_ == name and plain | kw == plain else build(name_, **kw)

    model.load_model = load_model


def _serve() -> None:
    import torch

    torch.set_num_threads(1)
    import encoder_worker.service  # noqa: F401 (imported once, here: what every life would cost)

    _build_model_once(os.environ["SVQA_MODEL"], os.environ["SVQA_DEVICE"])
    gc.freeze()  # what the parent made stays shared, and no life's collections walk it (0.4 s each)
    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "start" in command:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _life(**command["start"])
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            print(pid, flush=True)
        else:
            _, status = os.waitpid(command["wait"], 0)
            print(os.waitstatus_to_exitcode(status), flush=True)


class Lives:
    """The test's side: starts the forking parent with ``env`` and asks it for lives."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.workdir, self.count = workdir, 0
        self.running: set[int] = set()  # lives not yet waited for
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.lives"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self._reply(START_S) == "ready"

    def start(self, kill_at: str | None = None, **env: str) -> int:
        """A new life (``kill_at``: it SIGKILLs itself there; ``env``: SVQA_* settings of its own); its pid."""
        self.count += 1
        life = {"log": str(self.log(self.count)), "kill_at": kill_at, "env": env}
        pid = int(self._ask({"start": life}, 10.0))
        self.running.add(pid)
        return pid

    def log(self, life: int) -> Path:
        return self.workdir / f"life-{life}.log"

    def wait(self, pid: int, timeout_s: float) -> int:
        """How the life ended (Popen.returncode's convention); AssertionError, the life killed,
        if it runs on past ``timeout_s``."""
        self._send({"wait": pid})
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            self._reply(10.0)
            self.running.discard(pid)
            raise AssertionError(f"life {pid} still ran after {timeout_s:g} s")
        self.running.discard(pid)
        return int(self._reply(0))

    def kill(self, pid: int) -> int:
        """SIGKILL (it may have ended already: unreaped, its pid is still its own); how it ended."""
        os.kill(pid, signal.SIGKILL)
        return self.wait(pid, 10.0)

    def close(self) -> None:
        """Kill what still runs, then stop the parent."""
        for pid in list(self.running):
            self.kill(pid)
        self.proc.stdin.close()
        self.proc.wait(10)

    def _send(self, command: dict) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def _ask(self, command: dict, timeout_s: float) -> str:
        self._send(command)
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"no answer from the forking parent in {timeout_s:g} s"
        line = self.proc.stdout.readline()
        assert line, f"the forking parent exited with {self.proc.poll()}"
        return line.strip()


if __name__ == "__main__":
    _serve()
