# on the device: the question path with the Triton decode kernel off (flash, as before), same machine
python3 - --model random-3b --questions-only --sizes 32768,100000 --batch-questions 1,8,32 --batch-cache-tokens 32768 --decode-tokens 64 --pool-tokens 1400000 <<'PY'
import runpy, sys
import common.engine.lm as lm
lm.TRITON_DECODE = False
sys.argv = ["scripts/bench_engine.py", *sys.argv[1:]]
runpy.run_path("scripts/bench_engine.py", run_name="__main__")
PY
