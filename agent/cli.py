"""The `pitstop` command: parse, validate, dispatch; heavy modules load only when needed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.errors import ConfigError, PitstopError

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2


def _cmd_check_config(args: argparse.Namespace) -> int:
    from agent.config import load_config

    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{args.file}: ok (engine {cfg.engine.kind}, model {cfg.engine.model})")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pitstop", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check-config", help="validate a configuration file (exit 2 when invalid)")
    c.add_argument("file", type=Path)
    c.set_defaults(func=_cmd_check_config)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return EXIT_USAGE
    except PitstopError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130
