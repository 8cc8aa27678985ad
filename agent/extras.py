"""The optional parts of Pitstop: the pip extra each needs, and the error when it is missing."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from importlib.util import find_spec
from typing import Any

from agent.errors import MissingExtraError


class Extra(StrEnum):
    """A `[project.optional-dependencies]` entry of pyproject.toml."""

    # The reference engine (python -m agent.engines.refengine) and `pitstop make-model`. An
    # agent that supervises vLLM never needs it: vLLM brings its own torch, in its own
    # interpreter (engine.python).
    REFERENCE = "reference"
    # Snapshots in an S3-compatible store (snapshots.remote, `pitstop snapshot push|pull`).
    S3 = "s3"


# The top-level module each distribution of the extra provides (the same names, for these).
MODULES: dict[Extra, tuple[str, ...]] = {
    # jinja2 renders the model's chat template.
    Extra.REFERENCE: ("torch", "numpy", "safetensors", "tokenizers", "jinja2"),
    Extra.S3: ("boto3",),
}


def missing(extra: Extra, find: Callable[[str], Any] = find_spec) -> tuple[str, ...]:
    """The modules of `extra` this interpreter cannot import; found without importing them
    (torch takes seconds to import)."""
    return tuple(m for m in MODULES[extra] if find(m) is None)


def require(extra: Extra, what: str, find: Callable[[str], Any] = find_spec) -> None:
    """Raise MissingExtraError naming the pip command unless every module of `extra` is there.

    Example::

        require(Extra.REFERENCE, "the reference engine (engine.kind: reference)")
    """
    absent = missing(extra, find)
    if absent:
        raise MissingExtraError(
            f"{what} needs {', '.join(absent)}, which this interpreter lacks; install "
            f"Pitstop's {extra} extra: pip install 'pitstop[{extra}]'")
