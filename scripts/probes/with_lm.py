"""Run a benchmark script with some of lm.py's constants set otherwise, for an A/B on one machine:

    PYTHONPATH=. python3 scripts/probes/with_lm.py SPLIT_KV_MIN_TOKENS=4096 -- scripts/bench_engine.py --questions-only
    PYTHONPATH=. python3 scripts/probes/with_lm.py DECODE_BLOCKS_PER_SM=2 DECODE_MAX_SPLIT=128 -- scripts/probes/...

(values are Python literals).
"""

from __future__ import annotations

import ast
import runpy
import sys

import common.engine.lm as lm


def main() -> None:
    split = sys.argv.index("--")
    for setting in sys.argv[1:split]:
        name, value = setting.split("=", 1)
        if not hasattr(lm, name):
            raise SystemExit(f"lm.py has no {name}")
        setattr(lm, name, ast.literal_eval(value))
    sys.argv = sys.argv[split + 1 :]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
