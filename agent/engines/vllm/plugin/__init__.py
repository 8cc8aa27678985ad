"""The Pitstop plugin for vLLM: a model loader over held weights and a worker extension.

vLLM loads `register` (the `vllm.general_plugins` entry point) in every process it starts.
It only touches an engine that Pitstop launched with the plugin enabled, and only a vLLM
that has every internal the plugin uses (probes.NEEDS; the policy is support.fit_of's);
imports stdlib, torch, vLLM and Pitstop's tenant side only.
"""

from __future__ import annotations

import logging
import os

from agent.engines.vllm.plugin import support

# Under vLLM's logger: its handlers print it with the process name, like its own lines.
log = logging.getLogger("vllm.pitstop")


def register() -> None:
    """Register `--load-format pitstop`, when this engine is Pitstop's and its vLLM has every
    internal the plugin uses (the agent has checked the same before it asked for it)."""
    if os.environ.get(support.ENABLE_ENV) != "1":
        return
    from pathlib import Path

    import torch
    import vllm

    from agent.engines.vllm.plugin import probes, state

    # The agent enables the plugin only for a vLLM its policy accepts (vllm.plugin.untested):
    # here the version only has to be readable and the internals there.
    verdict = support.fit_of(vllm.__version__, cuda=bool(torch.version.cuda))
    found = [] if verdict.refused else probes.missing(Path(vllm.__file__).parent,
                                                       verdict.build)
    state.set_probed(vllm.__version__, verdict.fit, [m.describe() for m in found])
    if verdict.refused or found:
        # The loader stays unknown, so `--load-format pitstop` fails vLLM's start with
        # "not supported" rather than loading anything the plugin does not understand.
        log.error("pitstop plugin not registered: %s", verdict.detail if verdict.refused else
                  f"vLLM {vllm.__version__} lacks {probes.describe(found)}")
        return
    if verdict.probes_decide:
        log.warning("pitstop plugin: %s", verdict.detail)
    from vllm.model_executor.model_loader import register_model_loader

    from agent.engines.vllm.plugin.loader import PitstopModelLoader

    register_model_loader(support.LOAD_FORMAT)(PitstopModelLoader)
