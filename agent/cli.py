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


def _cmd_run(args: argparse.Namespace) -> int:
    from agent.run import run_agent

    return run_agent(args.config, verbose=args.verbose)


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from agent.config import load_config
    from agent.supervisor.status import StatusFile

    cfg = load_config(args.config)
    data = StatusFile(cfg.paths.run / "status.json").read()
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(format_status(data))
    return EXIT_OK if data["state"] == "ready" else EXIT_FAIL


def _cmd_install_units(args: argparse.Namespace) -> int:
    from agent import units

    if args.holder and not args.enable:
        print("pitstop: --holder only makes sense with --enable", file=sys.stderr)
        return EXIT_USAGE
    pitstop = args.pitstop_bin or units.default_pitstop_bin()
    paths = units.paths_for(pitstop.absolute(), args.config.absolute())
    if not args.config.exists():
        print(f"pitstop: note: {args.config} does not exist yet; the tmpfiles snippet uses the "
              "default directories", file=sys.stderr)
    for f in units.install(args.prefix, paths):
        print(f"installed {f}")
    if args.no_reload:
        return EXIT_OK
    done, warnings = units.activate(args.prefix, args.enable, args.holder)
    for c in done:
        print(f"ran: {c}")
    for w in warnings:
        print(f"pitstop: warning: {w}", file=sys.stderr)
    return EXIT_OK


def format_status(data: dict) -> str:
    import time

    lines = [f"state:    {data['state']}" + (f" ({data['reason']})" if data.get("reason") else "")]
    lines.append(f"engine:   {data.get('engine_kind', '?')}, pid {data.get('engine_pid') or '-'}")
    since = data.get("engine_ready_since")
    if since and data.get("engine_pid"):
        lines.append(f"uptime:   {time.time() - since:.0f}s")
    rec = data.get("last_recovery")
    if rec:
        lines.append(f"last recovery: {rec['path']} ({rec['cause']}) {rec['result']} in "
                     f"{rec['duration_s']:.2f}s")
        for f in rec.get("fallthroughs", []):
            lines.append(f"  fell through: {f}")
    lines.append(f"restarts: {data.get('restarts', 0)}")
    if data.get("front"):
        lines.append(f"front:    http://{data['front']}/v1")
    if data.get("metrics"):
        lines.append(f"metrics:  http://{data['metrics']}/metrics")
    return "\n".join(lines)


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

    r = sub.add_parser("run", help="run the agent in the foreground (what the systemd unit runs)")
    r.add_argument("--config", type=Path, help="pitstop.yaml (default: the embedded default)")
    r.add_argument("-v", "--verbose", action="store_true")
    r.set_defaults(func=_cmd_run)

    s = sub.add_parser("status", help="the agent's state, engine PID, uptime, last recovery")
    s.add_argument("--config", type=Path, help="pitstop.yaml (default: the embedded default)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_status)

    u = sub.add_parser("install-units",
                       help="install the systemd units, sysctl and tmpfiles snippets")
    u.add_argument("--prefix", type=Path, default=Path("/"),
                   help="root to install under (default /: the live system)")
    u.add_argument("--pitstop-bin", type=Path,
                   help="the pitstop command the units run (default: the one beside this Python)")
    u.add_argument("--config", type=Path, default=Path("/etc/pitstop/pitstop.yaml"),
                   help="the configuration the agent reads (default /etc/pitstop/pitstop.yaml)")
    u.add_argument("--enable", action="store_true",
                   help="enable pitstop-agent.service and the holders (not start them)")
    u.add_argument("--holder", action="append", default=[], metavar="GPU_UUID",
                   help="a GPU to enable a holder for, with --enable (repeatable)")
    u.add_argument("--no-reload", action="store_true",
                   help="only write the files: no daemon-reload, tmpfiles, sysctl or enabling")
    u.set_defaults(func=_cmd_install_units)
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
