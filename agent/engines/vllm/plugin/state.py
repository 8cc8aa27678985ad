"""The held weights of this worker process: set by the loader, used by the worker extension."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.engines.vllm.plugin.held import HeldParams


@dataclass
class Loaded:
    """What the loader did, for the extension's state answer (and the tests that read it)."""

    held: HeldParams
    source: str  # "holder" (attached: a warm start) or "disk" (loaded into the holder)
    seconds: float
    outside: list[str] = field(default_factory=list)
    # Lists again, at each state call, what the engine reads outside held memory (a
    # tensor vLLM makes after the load, say).
    check: Callable[[], list[str]] | None = None
    # Outside held memory by design: native kernels hold their addresses (post.pinned).
    in_image: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Probed:
    """What the plugin found of the vLLM it runs in when it registered."""

    version: str
    fit: str  # support.Fit: tested, patch, untested, unknown
    missing: list[str] = field(default_factory=list)


_current: Loaded | None = None
_probed: Probed | None = None


def set_probed(version: str, fit: str, missing: list[str]) -> None:
    global _probed
    _probed = Probed(version, str(fit), list(missing))


def probed() -> Probed | None:
    return _probed


def set_current(held: HeldParams, source: str, seconds: float, outside: list[str],
                check: Callable[[], list[str]] | None = None,
                in_image: list[str] | None = None) -> None:
    global _current
    _current = Loaded(held, source, seconds, outside, check, list(in_image or ()))


def loaded() -> Loaded | None:
    return _current


def current() -> HeldParams | None:
    return _current.held if _current is not None else None
