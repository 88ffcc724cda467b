"""A real RTSP server for tests and demos: GStreamer's gst-rtsp-server, run as a subprocess.

GStreamer's Python bindings (``gi``) come from Debian packages and live in the *system*
interpreter (/usr/bin/python3), not in the project venv, so this file has two halves:

* script (system python3, stdlib + gi only)::

      /usr/bin/python3 tests/rtsp_server.py --port 8554 --path /cam1            # live test pattern
      /usr/bin/python3 tests/rtsp_server.py --port 8554 --path /cam1 --file x.mp4

  ``--port 0`` picks a free port. Prints ``READY <url>`` once it listens.

* ``RtspServer`` (any python, stdlib only) starts/stops that script for pytest, including
  ``stop(kill=True)`` (SIGKILL) and ``start()`` again on the same port for reconnect tests.

Debian packages: gstreamer1.0-rtsp gir1.2-gst-rtsp-server-1.0 python3-gst-1.0 python3-gi
gstreamer1.0-plugins-base gstreamer1.0-plugins-good (rtph264pay, qtdemux, matroskademux)
gstreamer1.0-plugins-bad (h264parse) gstreamer1.0-plugins-ugly (x264enc) gstreamer1.0-libav
(avdec_h264 for --file); optional gstreamer1.0-x (timeoverlay clock in the test pattern).
"""

from __future__ import annotations

import argparse
import functools
import os
import select
import signal
import socket
import subprocess
import sys
import time

SYSTEM_PYTHON = os.environ.get("STREAMVQA_GST_PYTHON", "/usr/bin/python3")
_CHECK_GI = (
    "import gi; gi.require_version('Gst', '1.0'); gi.require_version('GstRtspServer', '1.0');"
    "from gi.repository import Gst, GstRtspServer; Gst.init(None);"
    "assert Gst.ElementFactory.find('x264enc') and Gst.ElementFactory.find('rtph264pay')"
)


@functools.cache
def gst_available() -> tuple[bool, str]:
    """(ok, reason): can the system python import gi + GstRtspServer and find x264enc?"""
    try:
        proc = subprocess.run([SYSTEM_PYTHON, "-c", _CHECK_GI], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{SYSTEM_PYTHON} not usable: {exc}"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"{SYSTEM_PYTHON} cannot load GStreamer RTSP server via gi: {tail}"
    return True, ""


class RtspServer:
    """One RTSP server subprocess serving ``rtsp://127.0.0.1:<port><path>``."""

    def __init__(
        self,
        port: int = 0,
        *,
        path: str = "/cam1",
        file: str | None = None,
        fps: int = 10,
        width: int = 320,
        height: int = 240,
        credentials: tuple[str, str] | None = None,
    ) -> None:
        self.port = port  # 0 = let the server pick; the real port is known after start()
        self.credentials = credentials  # (user, password): RTSP basic auth required
        self.path = path if path.startswith("/") else "/" + path
        self.file = file
        self.fps, self.width, self.height = fps, width, height
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        userinfo = f"{self.credentials[0]}:{self.credentials[1]}@" if self.credentials else ""
        return f"rtsp://{userinfo}127.0.0.1:{self.port}{self.path}"

    def start(self, timeout_s: float = 60.0) -> RtspServer:
        """Spawn the server and wait until it printed READY and its port accepts connections
        (a second or two; the default leaves room for Python and GStreamer on a loaded machine)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [
            SYSTEM_PYTHON,
            os.path.abspath(__file__),
            "--port",
            str(self.port),
            "--path",
            self.path,
            "--fps",
            str(self.fps),
            "--width",
            str(self.width),
            "--height",
            str(self.height),
        ]
        if self.file:
            cmd += ["--file", os.path.abspath(self.file)]
        if self.credentials:
            cmd += ["--user", self.credentials[0], "--password", self.credentials[1]]
        # Own session: a kill never reaches the test runner; stderr inherited so failures show in pytest.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        self.port = self._read_ready_port(deadline)
        self._wait_port(deadline)
        return self

    def _read_ready_port(self, deadline: float) -> int:
        assert self.proc is not None and self.proc.stdout is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"RTSP server exited early with code {self.proc.returncode}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if line.startswith("READY "):
                return int(line.split()[1].rsplit(":", 1)[1].split("/", 1)[0])
        self.stop(kill=True)
        raise TimeoutError("RTSP server did not report READY in time")

    def _wait_port(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop(kill=True)
        raise TimeoutError(f"RTSP server port {self.port} does not accept connections")

    def stop(self, *, kill: bool = False, timeout_s: float = 5.0) -> None:
        """SIGTERM (or SIGKILL with ``kill=True``, to simulate a crash) and reap the process."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            if not kill:
                proc.send_signal(signal.SIGCONT)  # a SIGSTOPped server (stall tests) must wake to exit
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> RtspServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- script half (system python + gi)


def _pattern_launch(fps: int, width: int, height: int, clock: bool) -> str:
    # is-live: frames are produced in real time like a camera. zerolatency: no B-frames and no
    # lookahead, so the first frame leaves the encoder at once. config-interval=-1: SPS/PPS with
    # every IDR, so a client joining a shared stream can start decoding at the next keyframe.
    overlay = "timeoverlay ! " if clock else ""
    return (
        f"( videotestsrc is-live=true pattern=ball ! video/x-raw,width={width},height={height},"
        f"framerate={fps}/1 ! {overlay}videoconvert ! "
        f"x264enc tune=zerolatency speed-preset=ultrafast key-int-max={fps} ! "
        f"video/x-h264,profile=baseline ! rtph264pay name=pay0 pt=96 config-interval=-1 )"
    )


def _file_launch(path: str) -> str:
    # Re-encode instead of remuxing: any container/codec works, and B-frames (RTP-unfriendly
    # timestamps) are removed. The file plays once per client, in real time.
    location = path.replace("\\", "\\\\").replace('"', '\\"')
    return (
        f'( filesrc location="{location}" ! decodebin ! videoconvert ! '
        "x264enc tune=zerolatency speed-preset=ultrafast key-int-max=10 ! "
        "video/x-h264,profile=baseline ! rtph264pay name=pay0 pt=96 config-interval=-1 )"
    )


def serve(
    port: int, path: str, file: str | None, fps: int, width: int, height: int, credentials: tuple[str, str] | None
) -> None:
    try:
        import gi
    except ImportError as exc:
        raise SystemExit(f"{exc}: run this script with the system python ({SYSTEM_PYTHON}), not a venv") from exc

    gi.require_version("Gst", "1.0")
    gi.require_version("GstRtspServer", "1.0")
    from gi.repository import GLib, Gst, GstRtspServer

    Gst.init(None)
    if file:
        launch, shared = _file_launch(file), False  # each client gets the file from the start
    else:
        # timeoverlay lives in gstreamer1.0-x (only a Recommends of plugins-base): optional.
        clock = Gst.ElementFactory.find("timeoverlay") is not None
        launch, shared = _pattern_launch(fps, width, height, clock), True
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(port))
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(launch)
    factory.set_shared(shared)
    if credentials:
        _require_basic_auth(GstRtspServer, server, factory, *credentials)
    server.get_mount_points().add_factory(path, factory)
    if server.attach(None) == 0:
        raise SystemExit(f"cannot listen on 127.0.0.1:{port}")
    loop = GLib.MainLoop()
    GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGTERM, loop.quit)
    GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGINT, loop.quit)
    print(f"READY rtsp://127.0.0.1:{server.get_bound_port()}{path}", flush=True)
    loop.run()


def _require_basic_auth(rtsp, server, factory, user: str, password: str) -> None:
    """Only clients with these credentials may play the mount (401 otherwise)."""
    auth = rtsp.RTSPAuth()
    token = rtsp.RTSPToken()
    token.set_string("media.factory.role", "viewer")
    auth.add_basic(rtsp.RTSPAuth.make_basic(user, password), token)
    server.set_auth(auth)
    permissions = rtsp.RTSPPermissions()
    permissions.add_permission_for_role("viewer", "media.factory.access", True)
    permissions.add_permission_for_role("viewer", "media.factory.construct", True)
    factory.set_permissions(permissions)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="RTSP test server (GStreamer); run with /usr/bin/python3")
    parser.add_argument("--port", type=int, default=8554, help="0 picks a free port")
    parser.add_argument("--path", default="/cam1")
    parser.add_argument("--file", help="video file to serve (re-encoded H.264); default: live test pattern")
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--user", help="require RTSP basic auth with --user and --password")
    parser.add_argument("--password")
    args = parser.parse_args(argv)
    path = args.path if args.path.startswith("/") else "/" + args.path
    credentials = (args.user, args.password) if args.user else None
    serve(args.port, path, args.file, args.fps, args.width, args.height, credentials)


if __name__ == "__main__":
    sys.exit(main())
