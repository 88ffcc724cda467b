"""Which threads of a running process hold the GIL, and doing what: py-spy samples it (`--gil`:
only stacks holding the GIL; `--nonblocking`: the process is never paused), this summarises.

A GPU worker's loop launches kernels from Python and hands the GIL over at every torch call; a
thread that holds it meanwhile delays the next launch while the device may sit idle. The GPU
loop's phase clock (common/engine/phases.py) says how long the loop waited off the CPU; this
says who held the GIL then. bench_pipeline's `--gil SECONDS` runs it on each worker over the
window's start. Alone, on any Python process:

    py-spy record --gil --nonblocking --threads --full-filenames -r 100 -d 20 -f raw -o gil.txt -p PID
    PYTHONPATH=. python scripts/gil_holders.py gil.txt
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from common.threadcpu import role

REPO = Path(__file__).resolve().parents[1]
RATE_HZ = 100
TOP = 15


class GilSampler:
    """py-spy recording `pid` for `seconds` into `raw`, from now; `summary()` waits for it."""

    def __init__(self, pid: int, seconds: float, raw: Path):
        self.raw, self.seconds = raw, max(1, round(seconds))
        spy = shutil.which("py-spy")
        self.error: str | None = None if spy else "py-spy is not on PATH"
        self.proc: subprocess.Popen[bytes] | None = None
        if spy:
            args = ["record", "--gil", "--nonblocking", "--threads", "--full-filenames", "-r", str(RATE_HZ)]
            args += ["-d", str(self.seconds), "-f", "raw", "-o", str(raw), "-p", str(pid)]
            self.proc = subprocess.Popen([spy, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def summary(self, timeout_s: float = 60.0) -> dict[str, Any]:
        if self.proc is not None:
            try:
                _, err = self.proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                err = b"timed out"
            if self.proc.returncode != 0:
                self.error = err.decode(errors="replace").strip()[-300:] or f"exit {self.proc.returncode}"
        if self.error is not None:
            return {"error": self.error}
        return summarize(self.raw.read_text(), window_s=self.seconds)


def summarize(raw: str, repo: Path = REPO, window_s: float | None = None) -> dict[str, Any]:
    """py-spy's raw stacks (`thread (TID): NAME;frame (file:line);... COUNT`, outermost first) as
    shares of the samples: by thread role, and by the innermost frame of this repository's code
    in the stack (the call that holds it, where the time is spent beneath it) with its role.
    `seconds`: how long the GIL was seen held; `held_share`: of the `window_s` sampled."""
    by_role: Counter[str] = Counter()
    by_call: Counter[tuple[str, str]] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        who = role(head.partition(": ")[2] or head)
        n = int(count)
        total += n
        by_role[who] += n
        ours = [f for f in frames if str(repo) in f and "/.venv/" not in f]
        by_call[(who, _short(ours[-1], repo) if ours else "(outside the repository)")] += n
    if not total:
        return {"samples": 0}
    return {
        "samples": total,
        "seconds": round(total / RATE_HZ, 2),
        **({"held_share": round(total / RATE_HZ / window_s, 3)} if window_s else {}),
        "by_thread": {k: round(v / total, 3) for k, v in by_role.most_common()},
        "by_call": [
            {"thread": who, "call": call, "share": round(n / total, 3)} for (who, call), n in by_call.most_common(TOP)
        ],
    }


def _short(frame: str, repo: Path) -> str:
    """`fn (/repo/a/b.py:12)` -> `fn (a/b.py:12)`."""
    return frame.replace(f"{repo}/", "")


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1]).read_text()), indent=1))
