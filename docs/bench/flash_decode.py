"""Run a benchmark script with decode rows' attention through flash, as before the Triton kernel
(lm.TRITON_DECODE off), for an A/B on one machine:

    PYTHONPATH=. python3 docs/bench/flash_decode.py scripts/bench_engine.py --model random-3b --questions-only ...
"""

from __future__ import annotations

import runpy
import sys

import common.engine.lm as lm

lm.TRITON_DECODE = False
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
