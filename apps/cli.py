"""`streamvqa` command line: one subcommand per service or tool.

Services (ingest, encoder, qa) parse their own flags through their config dataclass, so the
same settings come from flags, SVQA_* variables or a YAML file; tools parse with argparse.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from common.version import VERSION

# subcommand -> module with `main(argv: list[str]) -> int`
SERVICES = {
    "ingest": "ingest.service",
    "encoder": "encoder_worker.service",
    "qa": "qa_worker.service",
    "worker": "apps.worker",
    "ask": "qa_worker.client",
    "transcript": "qa_worker.client",
    "status": "apps.status",
    "demo": "apps.demo",
    "api": "api.service",
}


# services whose settings are checked before their module (and torch) is imported
CONFIGS = {
    "ingest": ("ingest.config", "IngestConfig"),
    "encoder": ("encoder_worker.config", "EncoderConfig"),
    "qa": ("qa_worker.config", "QAConfig"),
    "worker": ("apps.worker_config", "WorkerConfig"),
    "api": ("api.config", "ApiConfig"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--version"], ["-V"]):
        print(f"streamvqa {VERSION}")
        return 0
    if argv and argv[0] in CONFIGS:
        from common import boot

        module, cls = CONFIGS[argv[0]]
        boot.configure(getattr(importlib.import_module(module), cls), argv, f"streamvqa {argv[0]}")
    if argv and argv[0] in SERVICES:
        module = importlib.import_module(SERVICES[argv[0]])
        return module.main(argv)
    from apps import replay  # imports torch: only for the command that runs a model here

    parser = argparse.ArgumentParser(
        prog="streamvqa", description="Ask questions about live video.", epilog="streamvqa --version: the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{replay," + ",".join(SERVICES) + "}")
    replay.add_arguments(sub.add_parser("replay", help="stream a video file through the engine and ask"))
    ns = parser.parse_args(argv)
    return replay.run(ns)


if __name__ == "__main__":
    sys.exit(main())
