"""`--worker-extension-cls`: detach the held weights before a checkpoint, attach them after.

Called through vLLM's `/collective_rpc` (VLLM_SERVER_DEV_MODE=1, on the engine's private
Unix socket; the front never forwards it). The methods run in each worker between engine
steps, so no forward pass reads the weights while they are unmapped.
"""

from __future__ import annotations

import logging
from typing import Any

from agent.engines.vllm.plugin import state
from agent.errors import HolderError, MappingError

# Under vLLM's logger: its handlers print it with the process name, like its own lines.
log = logging.getLogger("vllm.pitstop")


class PitstopWorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`; `self` is the worker.

    Example (what the agent sends, as JSON, to POST /collective_rpc)::

        {"method": "pitstop_detach"}   # -> {"results": [{"held": {...}, "freed_bytes": N}]}
        {"method": "pitstop_attach"}   # -> {"results": [{"attached": true, ...}]}
    """

    def _pitstop_sleeps(self) -> bool:
        # On CUDA the KV pool goes too (vLLM's own sleep, level 1: the weights-tagged
        # buffers are copied out, the KV pool released, its addresses kept), so the image
        # is flat in model size; vLLM's CPU worker has no sleep mode.
        cfg = getattr(self, "vllm_config", None)
        return bool(cfg is not None and cfg.model_config.enable_sleep_mode
                    and cfg.device_config.device_type == "cuda")

    def pitstop_state(self) -> dict[str, Any]:
        loaded = state.loaded()
        if loaded is None:
            return {"held": None}
        held = loaded.held
        return {"source": loaded.source, "load_s": round(loaded.seconds, 3),
                "outside": loaded.outside,
                "held": {"digest": held.digest, "attached": held.attached,
                         "bytes": held.nbytes, "base": held.held.space.base,
                         "regions": held.identity}}

    def pitstop_detach(self) -> dict[str, Any]:
        held = state.current()
        if held is None:
            return {"held": None, "freed_bytes": 0}
        freed = 0
        if self._pitstop_sleeps():
            import torch

            before = torch.cuda.mem_get_info()[0]
            self.sleep(level=1)  # type: ignore[attr-defined]
            freed = torch.cuda.mem_get_info()[0] - before
        held.detach()
        freed += held.nbytes
        log.info("pitstop: held weights detached (%d bytes, addresses kept)", held.nbytes)
        return {"freed_bytes": freed, **self.pitstop_state()}

    def pitstop_attach(self) -> dict[str, Any]:
        held = state.current()
        if held is None:
            return {"attached": False, "error": "this engine holds no weights in the holder"}
        try:
            held.reattach()
        except (MappingError, HolderError) as e:
            # Serving other bytes at these addresses would be wrong, serving none is a
            # crash: the agent kills this engine and takes the next rung.
            log.error("pitstop: held weights cannot be re-attached: %s", e)
            return {"attached": False, "error": str(e)}
        if self._pitstop_sleeps():
            self.wake_up()  # type: ignore[attr-defined]
        log.info("pitstop: held weights re-attached at the same addresses")
        return {"attached": True, **self.pitstop_state()}
