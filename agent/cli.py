"""The `pitstop` command: parse, validate, dispatch; heavy modules load only when needed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from agent.cli_snapshots import cmd_drift, cmd_snapshot
from agent.errors import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    AgentRunningError,
    ConfigError,
    ModelError,
    PitstopError,
)
from agent.modelgen import QUANTIZATIONS


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _cmd_check_config(args: argparse.Namespace) -> int:
    from agent.node import conflicts, engines_to_check

    try:
        asked, node = engines_to_check(args.files, args.engine, args.engines_dir)
    except ConfigError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return EXIT_USAGE
    for e in asked:
        print(f"{e.path}: ok (engine {e.config.engine.kind}, model {e.config.engine.model})")
    found = conflicts(node)
    for c in found:
        print(f"pitstop: {c}", file=sys.stderr)
    if found:
        return EXIT_USAGE
    if len(node) > 1:
        print(f"{len(node)} engines ({', '.join(e.name for e in node)}): no port, directory "
              "or GPU memory claimed twice")
    return EXIT_OK


def _cmd_make_model(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from agent.modelgen import make_model, spec_for

    try:
        spec = spec_for(args.size, target_gib=args.target_gib, seed=args.seed, arch=args.arch,
                        quant=args.quant)
    except ModelError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.max_position_embeddings is not None:
        if args.max_position_embeddings < 16:
            print("make-model: --max-position-embeddings must be at least 16", file=sys.stderr)
            return EXIT_USAGE
        spec = replace(spec, max_position_embeddings=args.max_position_embeddings)
    made = make_model(args.dir, spec, force=args.force)
    gib = spec.weight_bytes() / (1 << 30)
    verb = "wrote" if made else "already present:"
    print(
        f"{verb} {args.dir} ({spec.arch}, {spec.num_hidden_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.dtype}"
        f"{'' if spec.quant == 'none' else ', linear weights ' + spec.quant}"
        f"{f', {spec.num_experts} experts' if spec.num_experts else ''}, "
        f"{gib:.3f} GiB of weights)"
    )
    return EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from agent.run import run_agent

    return run_agent(args.config, verbose=args.verbose, engine=args.engine or "")


def _read_status(config: Path | None) -> dict:
    from agent.config import load_config
    from agent.supervisor.status import StatusFile

    return StatusFile(load_config(config).paths.run / "status.json").read()


def _engine_statuses(engines_dir: Path) -> dict[str, dict]:
    """Each engine's status by name; one that cannot be read says why in its state."""
    from agent.errors import StatusError
    from agent.node import engine_names, engine_path

    out = {}
    for name in engine_names(engines_dir):
        try:
            out[name] = _read_status(engine_path(name, engines_dir))
        except (ConfigError, StatusError) as e:
            out[name] = {"state": "unknown", "reason": str(e)}
    return out


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from agent.status_text import format_status

    # No --config and no --engine: every engine of the node, or without any the one agent
    # of the embedded default configuration.
    every = _engine_statuses(args.engines_dir) if args.config is None else {}
    if not every:
        data = _read_status(args.config)
        print(json.dumps(data, indent=1) if args.json else format_status(data))
        return EXIT_OK if data["state"] == "ready" else EXIT_FAIL
    if args.json:
        print(json.dumps({"engines": every}, indent=1))
    else:
        print("\n\n".join(f"engine {name}\n  " + format_status(data).replace("\n", "\n  ")
                           for name, data in every.items()))
    return EXIT_OK if all(d["state"] == "ready" for d in every.values()) else EXIT_FAIL


def _cmd_reload(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from agent.config import load_config
    from agent.control import call

    cfg = load_config(args.config)
    result = asyncio.run(call(cfg.paths.run / "control.sock", "reload", timeout=60))
    from agent.status_text import format_reload

    print(json.dumps(result, indent=1) if args.json else format_reload(result))
    # Refused keys leave the agent running on their old values: worth a non-zero exit.
    return EXIT_FAIL if result["error"] or result["refused"] else EXIT_OK


def _cmd_install_units(args: argparse.Namespace) -> int:
    from agent import units
    from agent.node import conflicts, load_engines

    if (args.holder or args.vllm_preload) and not args.enable:
        print("pitstop: --holder and --vllm-preload only make sense with --enable",
              file=sys.stderr)
        return EXIT_USAGE
    engines = tuple(load_engines(args.engines_dir))
    clashes = conflicts(engines)
    for c in clashes:
        print(f"pitstop: {c}", file=sys.stderr)
    if clashes:
        return EXIT_USAGE
    pitstop = args.pitstop_bin or units.default_pitstop_bin()
    paths = units.paths_for(pitstop.absolute(), args.config.absolute(), args.holder_backend,
                            args.engines_dir.absolute(), engines)
    if not args.config.exists() and not engines:
        print(f"pitstop: note: {args.config} does not exist yet; the tmpfiles snippet uses the "
              "default directories", file=sys.stderr)
    for f in units.install(args.prefix, paths):
        print(f"installed {f}")
    if args.no_reload:
        return EXIT_OK
    done, warnings = units.activate(args.prefix, args.enable, args.holder,
                                    preloads=args.vllm_preload,
                                    engines=[e.name for e in engines])
    for c in done:
        print(f"ran: {c}")
    for w in warnings:
        print(f"pitstop: warning: {w}", file=sys.stderr)
    return EXIT_OK


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return n


def _cmd_holder(args: argparse.Namespace) -> int:
    gpu = args.gpu or ("cpu" if args.backend == "cpu" else None)
    if gpu is None:
        print("pitstop: holder: --gpu UUID is required with --backend cuda "
              "(nvidia-smi -L lists the UUIDs)", file=sys.stderr)
        return EXIT_USAGE
    if args.action == "serve":
        import logging

        from agent.holder.server import run_holder

        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if args.names or args.all:
            print("pitstop: holder: names and --all go with `release`", file=sys.stderr)
            return EXIT_USAGE
        from dataclasses import replace

        from agent.holder.refill import DEFAULT_TUNING

        if args.refill_rate is not None and args.refill_rate <= 0:
            print("pitstop: holder: --refill-rate must be a positive number of MB/s",
                  file=sys.stderr)
            return EXIT_USAGE
        rate = args.refill_rate * 1e6 if args.refill_rate else None
        return run_holder(args.backend, gpu, args.dir, max_bytes=args.max_bytes,
                          refill_tuning=replace(DEFAULT_TUNING, threads=args.refill_threads
                                                or DEFAULT_TUNING.threads),
                          refill_rate=rate, refill_at_start=not args.no_refill)
    from agent.holder.cli import holder_release, holder_status

    if args.action == "status":
        return holder_status(args.dir, gpu, as_json=args.json)
    if not args.names and not args.all:
        print("pitstop: holder release: name the regions, or --all", file=sys.stderr)
        return EXIT_USAGE
    return holder_release(args.dir, gpu, args.names, release_all=args.all)


def _cmd_vllm_preload(args: argparse.Namespace) -> int:
    import logging

    from agent.config import load_config
    from agent.engines.vllm.preload import run_daemon

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    cfg = load_config(args.config)
    if cfg.engine.kind != "vllm":
        print(f"pitstop: vllm-preload: engine.kind is {cfg.engine.kind} in {args.config}; the "
              "weight-cache daemon serves vLLM engines only", file=sys.stderr)
        return EXIT_USAGE
    python = str(cfg.engine.python) if cfg.engine.python else sys.executable
    return run_daemon(cfg, python, args.gpu)


def _cmd_vllm_snapshot(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from agent.checkpoint import build_store
    from agent.checkpoint.criu_locate import locate
    from agent.config import load_config
    from agent.engines.vllm.snapshot import VllmSnapshotBackend
    from agent.errors import SnapshotError

    cfg = load_config(args.config)
    python = str(cfg.engine.python) if cfg.engine.python else sys.executable
    try:
        criu = locate(cfg.snapshots.criu).path
    except SnapshotError:
        criu = None  # vLLM then looks for `criu` on PATH and says so when it is not there
    backend = VllmSnapshotBackend.from_config(cfg, python=python, criu=criu)
    store = build_store(cfg)
    if args.action == "create":
        from agent.checkpoint.backend import CreateRequest, take
        from agent.drift_watch import build_reader
        from agent.engines import build_adapter

        store.open()
        # The identity the agent compares a vLLM snapshot with: read the way the agent reads
        # it when vLLM's backend is chosen (Pitstop's CRIU then has no part in it).
        identity = build_reader(cfg, build_adapter(cfg), None)()
        info = take(store, backend, CreateRequest("vllm"), identity)
        m = backend.read(backend.artifact(info.path))
    elif args.action == "inspect":
        path = Path(args.id) if "/" in args.id else backend.artifact(store.path(args.id))
        m = backend.read(path, kept=False)
    else:
        rows = []
        for e in store.entries():
            if e.manifest is None or e.manifest.kind != "vllm":
                continue
            try:
                m = backend.read(backend.artifact(store.path(e.id)))
                rows.append({"id": e.id, "created": m.created_at, "model": m.model,
                             "bytes": m.artifact_bytes})
            except SnapshotError as err:
                rows.append({"id": e.id, "error": str(err)})
        print(json.dumps(rows, indent=1) if args.json else "\n".join(
            f"{r['id']}  " + (r.get("error") or f"{r['model']}  {r['bytes'] / 1e9:.2f} GB  "
                              f"{r['created']}") for r in rows) or "no vLLM snapshots")
        return EXIT_OK
    if args.json:
        print(json.dumps(vars(m), default=str, indent=1))
    else:
        print(f"{m.id}: {m.model}@{m.model_revision[:12]}, {m.artifact_bytes / 1e9:.2f} GB, "
              f"taken {m.created_at} on {m.identity['gpu_name']} ({m.identity['gpu_uuid']})")
    return EXIT_OK


def _cmd_doctor(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from agent.config import load_config
    from agent.doctor import format_checks, run_checks

    checks = run_checks(load_config(args.config))
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=1))
    else:
        print(format_checks(checks))
    return EXIT_FAIL if any(c.needed and not c.ok for c in checks) else EXIT_OK


def _cmd_digest(args: argparse.Namespace) -> int:
    import json

    from agent.config import load_config
    from agent.weights import WeightsDigester, cache_path_for

    cfg = load_config(args.config)
    model = args.model or cfg.engine.model
    d = WeightsDigester(cache_path_for(cfg.paths.state_dir)).digest(model, rehash=args.rehash)
    if args.json:
        print(json.dumps({"model": str(d.model), "digest": d.digest, "bytes_read": d.bytes_read,
                          "files_hashed": d.files_hashed, "seconds": round(d.seconds, 3),
                          "files": [vars(f) for f in d.files]}, indent=1))
    else:
        print(f"{d.digest}  {d.model}\n{len(d.files)} files, {d.files_hashed} hashed, "
              f"{d.bytes_read} bytes read in {d.seconds:.2f}s")
    return EXIT_OK


# agent/node.py's ENGINES_DIR, spelt here so that building the parser imports nothing heavy.
ENGINES_DIR_TEXT = "/etc/pitstop/engines"


def _config_options(p: argparse.ArgumentParser) -> None:
    """--config FILE, or --engine NAME for <engines dir>/NAME.yaml: which agent a command is
    about."""
    p.add_argument("--config", type=Path, help="pitstop.yaml (default: the embedded default, "
                   "or the engine's file with --engine)")
    p.add_argument("--engine", metavar="NAME", help="the engine NAME of this node: its file is "
                   "<engines dir>/NAME.yaml unless --config says otherwise")
    p.add_argument("--engines-dir", type=Path, metavar="DIR",
                   help=f"where the node's engines are (default {ENGINES_DIR_TEXT})")


def _resolve_engine(args: argparse.Namespace) -> None:
    """--engines-dir defaults to the node's; --engine NAME without --config means NAME's own
    file."""
    if not hasattr(args, "engines_dir"):
        return
    from agent.node import ENGINES_DIR, check_name, engine_path

    if args.engines_dir is None:
        args.engines_dir = ENGINES_DIR
    if getattr(args, "engine", None) is not None:
        check_name(args.engine)
        if hasattr(args, "config") and args.config is None:
            args.config = engine_path(args.engine, args.engines_dir)


def _configured(sub: argparse._SubParsersAction, name: str, text: str,
                func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """A command that reads pitstop.yaml (--config) and can answer in JSON (--json)."""
    a = sub.add_parser(name, help=text)
    _config_options(a)
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=func)
    return a


def _snapshot_parser(sub: argparse._SubParsersAction) -> None:
    """`pitstop snapshot ACTION`: its actions and their arguments."""
    sn = sub.add_parser("snapshot", help="create, list, inspect, verify or delete snapshots")
    snsub = sn.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (
        ("create", "ask the running agent to snapshot its engine at the next quiet moment"),
        ("list", "every snapshot, newest first"),
        ("inspect", "one snapshot's manifest"),
        ("memory", "what one snapshot's image holds, by process and kind of mapping"),
        ("verify", "check manifests, permissions and checksums (exit 1 when one is refused)"),
        ("delete", "remove snapshots"),
        ("push", "upload a snapshot (default: the newest) to the S3 store, only the chunks it "
                 "lacks"),
        ("pull", "download the newest snapshot of the S3 store that fits this host, verified "
                 "before it is published"),
    ):
        a = _configured(snsub, name, text, cmd_snapshot)
        if name in ("inspect", "memory"):
            a.add_argument("id")
        elif name == "verify":
            a.add_argument("ids", nargs="*", metavar="ID", help="default: all")
        elif name == "delete":
            a.add_argument("ids", nargs="+", metavar="ID")
        elif name == "list":
            a.add_argument("--quarantined", action="store_true",
                           help="the quarantine instead, newest first, in the same columns")
        if name in ("push", "pull"):
            a.add_argument("--url", metavar="s3://BUCKET/PREFIX",
                           help="the store (default: snapshots.remote); endpoint and "
                                "credentials from AWS_* variables and ~/.aws")
        if name == "push":
            a.add_argument("id", nargs="?", metavar="ID", help="default: the newest")
        elif name == "pull":
            a.add_argument("--kind", choices=["hybrid", "full"],
                           help="only this kind (default: hybrid, else full)")


def _make_model_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("make-model", help="write a random-weight model directory (Llama, "
                       "Qwen3-MoE; optionally FP8)")
    m.add_argument("dir", type=Path)
    m.add_argument("--size", default="tiny", choices=["tiny", "small", "medium"])
    m.add_argument("--target-gib", type=_positive_float, default=None,
                   help="make a bf16 model of about this many GiB (overrides --size)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--arch", default="llama", choices=["llama", "qwen3-moe"],
                   help="dense Llama, or Qwen3-MoE with 4 experts a layer, 2 per token")
    m.add_argument("--quant", default="none", choices=list(QUANTIZATIONS),
                   help="linear weights pre-quantized: FP8 in vLLM's fp8 format (one scale "
                        "per tensor) or compressed-tensors (one per output channel), int8 "
                        "in compressed-tensors W8A8, or 4-bit AWQ (GEMM format, a bf16 "
                        "model)")
    m.add_argument("--max-position-embeddings", type=int, default=None, metavar="N",
                   help="the longest context the model takes, prompt included (default "
                        "2048; RoPE tables are made for it, no weight changes size)")
    m.add_argument("--force", action="store_true", help="replace whatever DIR holds")
    m.set_defaults(func=_cmd_make_model)


def _holder_parser(sub: argparse._SubParsersAction) -> None:
    h = sub.add_parser("holder", help="the per-GPU memory holder: serve (default), status, "
                       "release")
    h.add_argument("action", nargs="?", choices=["serve", "status", "release"], default="serve")
    h.add_argument("names", nargs="*", help="regions to release")
    h.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    h.add_argument("--gpu", help="the GPU's UUID (GPU-...), or 'cpu' with --backend cpu")
    h.add_argument("--dir", type=Path, default=Path("/run/pitstop/holder"),
                   help="the socket is DIR/<gpu>/holder.sock (default /run/pitstop/holder)")
    h.add_argument("--max-bytes", type=int, help="refuse regions beyond this many bytes held")
    h.add_argument("--no-refill", action="store_true", help="do not load the weights the "
                   "refill plan in DIR/<gpu>/ names at start-up (the agent still may ask)")
    h.add_argument("--refill-threads", type=_positive_int, metavar="N",
                   help="reads in flight during a refill (default: the cores, at most 16)")
    h.add_argument("--refill-rate", type=float, metavar="MB_PER_S",
                   help="cap a refill's reads at this many MB/s (default: no cap)")
    h.add_argument("--all", action="store_true", help="release: every committed region")
    h.add_argument("--json", action="store_true", help="status: print JSON")
    h.add_argument("-v", "--verbose", action="store_true")
    h.set_defaults(func=_cmd_holder)


def _vllm_parsers(sub: argparse._SubParsersAction) -> None:
    vp = sub.add_parser("vllm-preload", help="run vLLM's weight-cache daemon for one GPU in the "
                        "foreground (what pitstop-vllm-preload@GPU.service runs)")
    _config_options(vp)
    vp.add_argument("--gpu", required=True,
                    help="the GPU: an index or a UUID (becomes CUDA_VISIBLE_DEVICES)")
    vp.set_defaults(func=_cmd_vllm_preload)

    vs = sub.add_parser("vllm-snapshot", help="vLLM's own snapshots (`vllm snapshot`): create, "
                        "inspect, list")
    vssub = vs.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (
        ("create", "run `vllm snapshot create` for vllm.snapshot.model (needs CUDA and GPU "
                   "memory for a second engine)"),
        ("inspect", "one snapshot's manifest, as `vllm snapshot inspect` reads it"),
        ("list", "every vLLM snapshot, newest first"),
    ):
        a = _configured(vssub, name, text, _cmd_vllm_snapshot)
        if name == "inspect":
            a.add_argument("id", help="a snapshot id, or a directory path")


def _units_parser(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser("install-units",
                       help="install the systemd units, sysctl and tmpfiles snippets")
    u.add_argument("--prefix", type=Path, default=Path("/"),
                   help="root to install under (default /: the live system)")
    u.add_argument("--pitstop-bin", type=Path,
                   help="the pitstop command the units run (default: the one beside this Python)")
    u.add_argument("--config", type=Path, default=Path("/etc/pitstop/pitstop.yaml"),
                   help="the configuration the agent reads (default /etc/pitstop/pitstop.yaml)")
    u.add_argument("--engines-dir", type=Path, metavar="DIR",
                   help=f"the node's engines, one <name>.yaml each, one agent each "
                   f"(pitstop-agent@<name>; default {ENGINES_DIR_TEXT})")
    u.add_argument("--enable", action="store_true",
                   help="enable the agents (pitstop-agent@<name> for each engine in "
                   "--engines-dir, else pitstop-agent.service) and the holders (not start "
                   "them)")
    u.add_argument("--holder", action="append", default=[], metavar="GPU_UUID",
                   help="a GPU to enable a holder for, with --enable (repeatable)")
    u.add_argument("--vllm-preload", action="append", default=[], metavar="GPU",
                   help="a GPU (index or UUID) to enable vLLM's weight-cache daemon for, with "
                   "--enable (repeatable; needs vllm.preload.enabled)")
    u.add_argument("--holder-backend", choices=["cuda", "cpu"], default="cuda",
                   help="what the holders hold memory with (default cuda; cpu: memfd, no GPU)")
    u.add_argument("--no-reload", action="store_true",
                   help="only write the files: no daemon-reload, tmpfiles, sysctl or enabling")
    u.set_defaults(func=_cmd_install_units)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pitstop", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check-config", help="validate configuration files, and a node's "
                       "engines against each other (exit 2 when invalid)")
    c.add_argument("files", nargs="*", type=Path, metavar="FILE",
                   help="files to check; several are checked as the engines of one node "
                   "(default: every engine in --engines-dir)")
    c.add_argument("--engine", metavar="NAME", help="check FILE (default: NAME's own file) as "
                   "the new version of engine NAME, against the node's other engines")
    c.add_argument("--engines-dir", type=Path, metavar="DIR",
                   help=f"where the node's engines are (default {ENGINES_DIR_TEXT})")
    c.set_defaults(func=_cmd_check_config)

    _make_model_parser(sub)

    r = sub.add_parser("run", help="run the agent in the foreground (what the systemd unit runs)")
    _config_options(r)
    r.add_argument("-v", "--verbose", action="store_true")
    r.set_defaults(func=_cmd_run)

    _configured(sub, "status", "the agent's state, engine PID, uptime, last recovery",
                _cmd_status)
    _configured(sub, "reload", "re-read the configuration in the running agent; say which "
                "changed keys apply and which need a restart (exit 1 then)", _cmd_reload)
    _configured(sub, "doctor", "can this host snapshot and restore? (exit 1 when not)",
                _cmd_doctor)

    _snapshot_parser(sub)

    dr = _configured(sub, "drift", "compare a snapshot's identity with this host's (exit 1 "
                     "when a field differs)", cmd_drift)
    dr.add_argument("--snapshot", metavar="ID", help="default: the newest snapshot")
    dg = _configured(sub, "digest", "the weights digest of engine.model (cached by stat)",
                     _cmd_digest)
    dg.add_argument("--rehash", action="store_true", help="read every file again, ignoring "
                    "the cache (and refresh it)")
    dg.add_argument("--model", type=Path, help="another model directory than engine.model")

    _holder_parser(sub)

    _vllm_parsers(sub)

    _units_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _resolve_engine(args)
        return int(args.func(args))
    except (ConfigError, AgentRunningError) as e:
        # Starting again cannot fix either (the unit's RestartPreventExitStatus=2).
        print(f"pitstop: {e}", file=sys.stderr)
        return EXIT_USAGE
    except PitstopError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130
