"""`streamvqa` command line: one subcommand per service or tool.

Services (ingest, encoder, qa) parse their own flags through their config dataclass, so the
same settings come from flags, SVQA_* variables or a YAML file; tools parse with argparse.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICES:
        module = importlib.import_module(SERVICES[argv[0]])
        return module.main(argv)
    from apps import replay  # torch: only for the tool that needs it (`streamvqa api` must never load it)

    parser = argparse.ArgumentParser(prog="streamvqa", description="Ask questions about live video.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{replay," + ",".join(SERVICES) + "}")
    replay.add_arguments(sub.add_parser("replay", help="stream a video file through the engine and ask"))
    ns = parser.parse_args(argv)
    return replay.run(ns)


if __name__ == "__main__":
    sys.exit(main())
