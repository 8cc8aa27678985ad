"""The Pitstop plugin for vLLM: a model loader over held weights and a worker extension.

vLLM loads `register` (the `vllm.general_plugins` entry point) in every process it starts.
It only touches an engine that Pitstop launched with the plugin enabled, and only a vLLM
series the plugin supports (support.SUPPORTED); imports stdlib, torch, vLLM and Pitstop's
tenant side only.
"""

from __future__ import annotations

import logging
import os

from agent.engines.vllm.plugin import support

# Under vLLM's logger: its handlers print it with the process name, like its own lines.
log = logging.getLogger("vllm.pitstop")


def register() -> None:
    """Register `--load-format pitstop`, when this engine is Pitstop's and its vLLM fits."""
    if os.environ.get(support.ENABLE_ENV) != "1":
        return
    import torch
    import vllm

    refusal = support.version_refusal(vllm.__version__, cuda=bool(torch.version.cuda))
    if refusal is not None:
        # The loader stays unknown, so `--load-format pitstop` fails vLLM's start with
        # "not supported" rather than loading anything the plugin does not understand.
        log.error("pitstop plugin not registered: %s", refusal)
        return
    from vllm.model_executor.model_loader import register_model_loader

    from agent.engines.vllm.plugin.loader import PitstopModelLoader

    register_model_loader(support.LOAD_FORMAT)(PitstopModelLoader)
