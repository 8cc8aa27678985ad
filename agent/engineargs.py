"""What an engine's command line (engine.args) says, read as vLLM's parser reads it: a flag's
value, and the number of workers a size flag asks for."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from agent.errors import ConfigError

# vLLM's flags for each parallel size, long and short.
TENSOR_PARALLEL = ("--tensor-parallel-size", "-tp")
PIPELINE_PARALLEL = ("--pipeline-parallel-size", "-pp")
DATA_PARALLEL = ("--data-parallel-size", "-dp")


def _spelled(name: str) -> str:
    """A long flag as vLLM's parser takes it: `--x_y` is `--x-y`."""
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def flag_value(args: Sequence[str], flags: Iterable[str]) -> str | None:
    """The value `args` give the first of `flags` (or any other spelling of it in `flags`),
    None when absent. `--x N` and `--x=N` alike, `--x_y` as `--x-y`, and the last one given
    wins, as with argparse; a flag at the end with no value reads as ""."""
    flags = tuple(flags)
    found: str | None = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        name = _spelled(name)
        if name in flags:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return found


def switch(args: Sequence[str], flag: str) -> bool:
    """Whether `args` turn on one of vLLM's on/off flags (`--x`, its negation `--no-x`, the
    last one given wins, off when neither is given)."""
    off = "--no-" + flag[2:]
    given = [name for name in map(_spelled, args) if name in (flag, off)]
    return bool(given) and given[-1] == flag


def workers(args: Sequence[str], flags: tuple[str, ...]) -> int:
    """The size one of vLLM's parallel flags (`flags`) gives, 1 when absent; ConfigError
    naming the flag for anything but a whole number of 1 or more."""
    raw = flag_value(args, flags)
    if raw is None:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(
            f"engine.args: {flags[0]} {raw!r} is not a number of workers (a "
            "whole number, 1 or more)"
        )
    return int(raw)
