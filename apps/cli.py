"""`streamvqa` command line: one subcommand per service or tool.

Services (ingest, encoder, qa, worker, api) parse their own flags through their config dataclass,
so the same settings come from flags, SVQA_* variables or a YAML file; tools parse with argparse.
A command's module is imported only when it runs: `streamvqa --help` and the tools that run no
model never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from common.version import VERSION

# subcommand -> (module with `main(argv: list[str]) -> int`, what it does in one line)
SERVICES = {
    "demo": ("apps.demo", "the whole pipeline here: a private Redis, a generated camera, answers"),
    "replay": ("apps.replay", "run a video file through the engine here and ask (JSON lines)"),
    "ingest": ("ingest.service", "read cameras and files into Redis frame streams"),
    "encoder": ("encoder_worker.service", "encode each stream's frames into the model's KV cache (GPU)"),
    "qa": ("qa_worker.service", "answer questions and run jobs on the cache versions (GPU)"),
    "worker": ("apps.worker", "encoder and qa in one process, one copy of the weights (GPU)"),
    "api": ("api.service", "the HTTP API, OpenAI-compatible chat and the web page"),
    "ask": ("qa_worker.client", "ask about a stream; prints the answer as it is decoded"),
    "transcript": ("qa_worker.client", "a stream's transcript as WebVTT, SRT or JSON"),
    "search": ("qa_worker.search_cli", "search the cameras' past: time ranges ranked by the model"),
    "status": ("apps.status", "streams, versions, queues and workers, from Redis"),
    "recorder": ("recorder.service", "keep every camera's frames on disk (the frames log), with retention"),
    "segments": ("apps.segments", "save the cache's segments to a disk before a planned reboot, load them after"),
}


# services whose settings are checked before their module (and torch) is imported
CONFIGS = {
    "ingest": ("ingest.config", "IngestConfig"),
    "encoder": ("encoder_worker.config", "EncoderConfig"),
    "qa": ("qa_worker.config", "QAConfig"),
    "worker": ("apps.worker_config", "WorkerConfig"),
    "api": ("api.config", "ApiConfig"),
    "recorder": ("recorder.config", "RecorderConfig"),
}
EXIT_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a tool whose reader went away
EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a command stopped by Ctrl-C


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is an "Exception ignored" message
        return code
    except BrokenPipeError:
        # The reader went away (`streamvqa status | head -1`): stop quietly, as a tool killed by
        # SIGPIPE does. Python ignores SIGPIPE, so writes fail instead; stdout goes to /dev/null so
        # that nothing more fails on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except KeyboardInterrupt:
        # Ctrl-C while a tool waits (`ask`, `search`): the person asked for it, so one line and the
        # shell's code for it, not a traceback from whichever socket read it landed in.
        import structlog  # here: `streamvqa --help` imports as little as it can

        from common.logs import configure_logging

        if not structlog.is_configured():  # stopped before its command set logging up: still JSON, stderr
            configure_logging("INFO")
        structlog.get_logger().error("interrupted", exit_code=EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED


def _run(argv: list[str]) -> int:
    if argv in (["--version"], ["-V"]):
        print(f"streamvqa {VERSION}")
        return 0
    if not argv or argv[0] not in SERVICES:
        parser = _parser()
        parser.parse_args(argv)  # --help, or an unknown command: exits
        parser.error("the command comes first")
    if argv[0] in CONFIGS:
        from common import boot

        every = [getattr(importlib.import_module(module), cls) for module, cls in CONFIGS.values()]
        module, cls = CONFIGS[argv[0]]
        boot.configure(getattr(importlib.import_module(module), cls), argv, f"streamvqa {argv[0]}", every)
    return importlib.import_module(SERVICES[argv[0]][0]).main(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamvqa",
        description="Ask questions about live video.",
        epilog="streamvqa COMMAND --help: its flags and their SVQA_* variables; streamvqa --version: the version",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, line) in SERVICES.items():
        sub.add_parser(name, help=line, add_help=False)
    return parser


if __name__ == "__main__":
    sys.exit(main())
