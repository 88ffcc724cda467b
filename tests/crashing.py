"""`streamvqa` with a poison question: answering a question whose text holds ``POISON`` kills the
process with SIGKILL at once, as a segfault or the OOM killer would (no handler, no cleanup).
Run as ``python -m tests.crashing qa ...`` (``Services.start(..., module="tests.crashing")``)."""

from __future__ import annotations

import os
import signal
import sys

from apps import cli
from qa_worker import answering

POISON = "POISON"
_answer_valid = answering.Answerer._answer_valid


def _dies_on_poison(self: answering.Answerer, q, *args):
    if POISON in q.question:
        os.kill(os.getpid(), signal.SIGKILL)
    return _answer_valid(self, q, *args)


answering.Answerer._answer_valid = _dies_on_poison

if __name__ == "__main__":
    sys.exit(cli.main())
