"""``xronos`` command line: one sub-command per module in this package."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from xronos import __version__
from xronos.errors import UserError, WorkerError

COMMANDS = ("finetune", "generate", "profile", "plan", "bench", "export", "worker", "join")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="xronos",
        description="Heterogeneity-aware tensor-parallel fine-tuning across CPU edge devices.",
    )
    parser.add_argument("--version", action="version", version=f"xronos {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show worker tracebacks on failure"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"xronos.cli.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except UserError as e:
        print(f"xronos: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"xronos: error: {e}", file=sys.stderr)
        if args.verbose and e.details:
            print(e.details, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("xronos: interrupted; workers stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
