"""`--worker-extension-cls`: detach the held weights before a checkpoint, attach them after.

Called through vLLM's `/collective_rpc` (VLLM_SERVER_DEV_MODE=1, on the engine's private
Unix socket; the front never forwards it). The methods run in each worker between engine
steps, so no forward pass reads the weights while they are unmapped.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
from typing import Any

from agent.engines.vllm.plugin import state
from agent.errors import HolderError, MappingError
from agent.tenant.trim import Trimmed, give_back

# Under vLLM's logger: its handlers print it with the process name, like its own lines.
log = logging.getLogger("vllm.pitstop")

MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def drop_pages(ptr: int, nbytes: int) -> int:
    """Give the whole pages of [ptr, ptr + nbytes) back to the kernel; they read as zeros
    when next touched, and CRIU has nothing of them to dump. The bytes dropped."""
    page = mmap.PAGESIZE
    start = -(-ptr // page) * page
    end = (ptr + nbytes) // page * page
    if end <= start:
        return 0
    if _libc.madvise(start, end - start, MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {end - start} bytes "
                      f"at {start:#x} failed")
    return end - start


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
        return (cfg is not None and cfg.model_config.enable_sleep_mode
                and self._pitstop_on_cuda())

    def pitstop_state(self) -> dict[str, Any]:
        probed = state.probed()
        # The plugin's probes of the vLLM it runs in: its release, how it stands against
        # the tested table, what it lacks (nothing, or the plugin would not have loaded).
        vllm = dataclasses.asdict(probed) if probed is not None else None
        loaded = state.loaded()
        if loaded is None:
            # Nothing held: vLLM loaded as it does without the plugin.
            return {"held": None, "vllm": vllm, "outside": []}
        held = loaded.held
        # Listed now, not at the load: what the engine made since counts too. Only while
        # attached (a detached set's addresses are reserved, not readable).
        outside = loaded.check() if loaded.check and held.attached else loaded.outside
        return {"source": loaded.source, "load_s": round(loaded.seconds, 3),
                "outside": outside, "in_image": loaded.in_image, "vllm": vllm,
                "held": {"digest": held.digest, "attached": held.attached,
                         "bytes": held.nbytes, "base": held.held.space.base,
                         "regions": held.identity}}

    def pitstop_detach(self) -> dict[str, Any]:
        held = state.current()
        if held is None:
            return {"freed_bytes": 0, **self.pitstop_state()}
        freed = 0
        if self._pitstop_sleeps():
            import torch

            before = torch.cuda.mem_get_info()[0]
            self.sleep(level=1)  # type: ignore[attr-defined]
            freed = torch.cuda.mem_get_info()[0] - before
        else:
            freed = self._pitstop_drop_host_kv()
        held.detach()
        freed += held.nbytes
        log.info("pitstop: held weights detached (%d bytes, addresses kept)", held.nbytes)
        # Only a smaller image rides on the trim: a failure of it must not fail the detach
        # (the agent would then leave an engine serving with its weights unmapped).
        try:
            trimmed = give_back(cuda=self._pitstop_on_cuda())
        except Exception as e:  # noqa: BLE001 - any failure of it is only logged
            log.warning("pitstop: memory not given back before the checkpoint: %s", e)
            trimmed = Trimmed(host_bytes=0, gpu_bytes=0)
        log.info("pitstop: before the checkpoint, %s", trimmed.describe())
        return {"freed_bytes": freed, "trimmed": dataclasses.asdict(trimmed),
                **self.pitstop_state()}

    def _pitstop_on_cuda(self) -> bool:
        cfg = getattr(self, "vllm_config", None)
        return cfg is not None and str(cfg.device_config.device).startswith("cuda")

    def _pitstop_drop_host_kv(self) -> int:
        """The CPU worker's KV pool: its pages dropped, its tensors (and addresses) kept.

        The agent reset the prefix cache first and no request runs, so no block's content
        is needed again: they are written before they are read, as after a fresh start."""
        runner = getattr(self, "model_runner", None)
        seen: dict[int, int] = {}
        for t in getattr(runner, "kv_caches", None) or []:
            if t is not None and t.device.type == "cpu":
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(drop_pages(ptr, n) for ptr, n in seen.items())

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
            # With its state ("held" set): the agent fails the resume, and the restore
            # with it, rather than ask a canary of an engine without its weights.
            return {**self.pitstop_state(), "attached": False, "error": str(e)}
        if self._pitstop_sleeps():
            self.wake_up()  # type: ignore[attr-defined]
        log.info("pitstop: held weights re-attached at the same addresses")
        return {"attached": True, **self.pitstop_state()}
