"""Shared by the tests/test_vllm_paths*.py files: configs, the vLLM interpreter, its parser."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from agent.config import Config, parse_config
from agent.engines.vllm.cli import VERSION_PATCH
from tests.prereq import require
from tests.vllmproc import VLLM_PYTHON

REVISION = "0123456789abcdef0123456789abcdef01234567"


def vllm_python() -> Path:
    require(os.access(VLLM_PYTHON, os.X_OK),
            f"no vLLM interpreter at {VLLM_PYTHON}; run `make vllm` (scripts/install-vllm.sh)")
    return VLLM_PYTHON


def vllm_config(tmp: Path, model: Path | None = None, *, python: Path | None = None,
                engine: dict | None = None, **sections: Any) -> Config:
    data: dict[str, Any] = {
        "engine": {"kind": "vllm", "model": str(model or tmp / "model"),
                   "served_model_name": "tiny", "socket": str(tmp / "run" / "engine.sock"),
                   **({"python": str(python)} if python else {}), **(engine or {})},
        "paths": {"state_dir": str(tmp / "state")},
        **sections,
    }
    return parse_config(data, "<test>")


# Builds vLLM's parsers the way its own entry points do (vllm/entrypoints/cli/main.py for
# `vllm snapshot|preload`, launchers/api_server/entry.py for the API server), parses each argv
# and reports what it made of it, or vLLM's error. Nothing is started.
_HARNESS = """
import contextlib, io, json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for case in json.load(sys.stdin):
    argv, err = case["argv"], io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if case["kind"] in ("serve", "model"):
                from vllm.entrypoints.launchers.cli_args import (
                    make_arg_parser, validate_parsed_serve_args)
                args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
                validate_parsed_serve_args(args)
                from vllm.engine.arg_utils import EngineArgs
                EngineArgs.from_cli_args(args).create_load_config()
                if case["kind"] == "model":  # reads the model's config.json, as a start does
                    args.max_model_len = EngineArgs.from_cli_args(
                        args).create_model_config().max_model_len
            else:
                import vllm.entrypoints.cli.preload as pre
                import vllm.entrypoints.cli.snapshot as snap
                parser = FlexibleArgumentParser()
                sub = parser.add_subparsers(dest="subparser")
                create = argv[:2] == ["snapshot", "create"]
                for cmd in [*snap.cmd_init(create_requested=create), *pre.cmd_init()]:
                    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
                args = parser.parse_args(argv)
                if create:
                    snap.validate_create_args(args)
        got = {k: v for k, v in vars(args).items() if k in case.get("want", ())}
        if case.get("child"):
            from vllm.snapshot.controller import _child_engine_argv
            got["child"] = _child_engine_argv(args, tuple(argv[2:]))
        out.append({"ok": True, "args": got})
    except SystemExit as e:
        last = (err.getvalue().strip().splitlines() or [""])[-1]
        out.append({"ok": False, "error": f"exit {e.code}: {last}"})
    except Exception as e:
        out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
print("RESULT " + json.dumps(out, default=str))
"""


def vllm_parse(python: Path, cases: list[dict]) -> list[dict]:
    """Each case {"kind": "serve"|"model"|"cli", "argv": [...], "want": [attr...]} parsed by
    the real vLLM in `python` ("model" also builds vLLM's model config from the model's files);
    one subprocess for all (vLLM's import takes seconds)."""
    done = subprocess.run([str(python), "-c", VERSION_PATCH + _HARNESS], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=300, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])
