"""The `pitstop` command: parse, validate, dispatch; heavy modules load only when needed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.errors import ConfigError, PitstopError

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _cmd_check_config(args: argparse.Namespace) -> int:
    from agent.config import load_config

    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{args.file}: ok (engine {cfg.engine.kind}, model {cfg.engine.model})")
    return EXIT_OK


def _cmd_make_model(args: argparse.Namespace) -> int:
    from agent.modelgen import make_model, spec_for

    spec = spec_for(args.size, target_gib=args.target_gib, seed=args.seed)
    made = make_model(args.dir, spec, force=args.force)
    gib = spec.weight_bytes() / (1 << 30)
    verb = "wrote" if made else "already present:"
    print(
        f"{verb} {args.dir} ({spec.num_hidden_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.dtype}, {gib:.3f} GiB of weights)"
    )
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pitstop", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check-config", help="validate a configuration file (exit 2 when invalid)")
    c.add_argument("file", type=Path)
    c.set_defaults(func=_cmd_check_config)

    m = sub.add_parser("make-model", help="write a random-weight Llama model directory")
    m.add_argument("dir", type=Path)
    m.add_argument("--size", default="tiny", choices=["tiny", "small", "medium"])
    m.add_argument("--target-gib", type=_positive_float, default=None,
                   help="make a bf16 model of about this many GiB (overrides --size)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true", help="replace whatever DIR holds")
    m.set_defaults(func=_cmd_make_model)
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
