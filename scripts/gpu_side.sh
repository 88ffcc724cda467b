#!/usr/bin/env bash
# gpu_run.sh's steps side by side on a host of several GPUs, one group of steps a GPU, in one device
# call: a machine of 2 or 4 GPUs is held for the time of the longest group, not of all of them.
#
#   bash scripts/gpu_side.sh "tests questions chunks" "history" "ASKERS=32 pipeline" "CAMERAS=100 pipeline"
#
# Group i runs on GPU i (CUDA_VISIBLE_DEVICES=i) with its own $OUT/gI; leading NAME=VALUE words are
# its environment (gpu_run.sh's ASKERS, CAMERAS, STORE, DURATION, any SVQA_* setting). Each group is
# packed into $OUT/gI.tgz (the device tool brings back 8 files: up to 8 groups) and its last lines
# are printed. The wheels (.whl, carried) are installed once first: two installs into one /tmp/site
# collide. /dev/shm is remounted to hold every pipeline's store (about 1.3 GB a camera): 110 GB a GPU
# (SHM_SIZE=...G for another size; an H200 host has 128 GiB a GPU).
# SIDE_LIMIT_S bounds each group (default 570 s: inside one command's 10 minutes, with the packing).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" WHEELS_INSTALLED=1  # gpu_run.sh: not again
if command -v nvidia-smi >/dev/null; then  # a GPU machine: its MemTotal starts small and grows, so not from it
  size="${SHM_SIZE:-$(($(nvidia-smi -L | wc -l) * 110))G}"
  mount -o remount,size="$size" /dev/shm || echo "/dev/shm not remounted to $size" >&2
fi

i=0
for group in "$@"; do
  read -ra words <<<"$group"
  env_words=() steps=()
  for w in "${words[@]}"; do
    if [[ ${#steps[@]} -eq 0 && $w == *=* ]]; then env_words+=("$w"); else steps+=("$w"); fi
  done
  mkdir -p "$OUT/g$i"
  (CUDA_VISIBLE_DEVICES=$i OUT="$OUT/g$i" timeout "${SIDE_LIMIT_S:-570}" env "${env_words[@]}" \
    bash scripts/gpu_run.sh "${steps[@]}" >"$OUT/g$i/run.txt" 2>&1; echo $? >"$OUT/g$i/rc") &
  i=$((i + 1))
done
wait
status=0
for ((g = 0; g < i; g++)); do
  echo "== GPU $g: $(sed -n "$((g + 1))p" <(printf '%s\n' "$@"))"
  tail -n 5 "$OUT/g$g/run.txt"
  rc=$(cat "$OUT/g$g/rc")
  [ "$rc" = 0 ] || { echo "== GPU $g: exit status $rc"; status=1; }
  tar czf "$OUT/g$g.tgz" -C "$OUT" "g$g" && rm -rf "${OUT:?}/g$g"
done
exit $status
