"""`--load-format pitstop`: the model's parameters live in the holder, at fixed addresses."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import (
    initialize_model,
    process_weights_after_loading,
)
from vllm.utils.torch_utils import set_default_torch_dtype

from agent.engines.vllm.plugin import post, registry, state, support
from agent.engines.vllm.plugin.held import (
    HeldParams,
    give_back_storage,
    held_bytes,
    params_without_storage,
    specs_of,
)
from agent.engines.vllm.plugin.online import ONLINE_RESTARTABLE, online_done
from agent.engines.vllm.plugin.optional import already_processed
from agent.engines.vllm.plugin.support import DIGEST_KEY, SOCKET_KEY, held_key

# Under vLLM's logger: its handlers print it with the process name, like its own lines.
log = logging.getLogger("vllm.pitstop")


class PitstopModelLoader(BaseModelLoader):
    """Weights allocated by Pitstop's holder and bound into vLLM's model in place.

    First start: the parameters' storage is made a held region, vLLM's own weight loaders
    fill it from disk, and the region is committed. Later starts (the warm rung) attach
    the committed region: no weight is read from disk. Either way the parameters sit at
    the held addresses before anything (a CUDA graph, oneDNN) captures them, so a
    detach before a checkpoint and a re-attach at the same addresses after the restore
    leave every pointer valid.

    A quantized or mixture-of-experts model is held as vLLM's post-processing left it
    (quantized weights, scales, repacked expert stacks, buffers): those bytes, laid out by
    the region's own header, are what every start maps, and a warm start has vLLM only
    rebuild its Python-side state (agent/engines/vllm/plugin/post.py).
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        try:
            self.socket = Path(str(extra.pop(SOCKET_KEY)))
            # The weights' digest; `digest` is what this worker's set is held under (its
            # rank's key: set at load_model).
            self.model_digest = str(extra.pop(DIGEST_KEY))
            self.digest = self.model_digest
        except KeyError as e:
            raise ValueError(f"--load-format pitstop needs --model-loader-extra-config with "
                             f"{SOCKET_KEY!r} and {DIGEST_KEY!r}; {e.args[0]!r} is missing "
                             "(Pitstop's agent sets both)") from None
        if extra:
            raise ValueError(f"--load-format pitstop: unknown --model-loader-extra-config "
                             f"keys {sorted(extra)}; it takes {SOCKET_KEY!r} and {DIGEST_KEY!r}")
        self._disk = DefaultModelLoader(dataclasses.replace(
            load_config, load_format="auto", model_loader_extra_config={}))

    def download_model(self, model_config: ModelConfig) -> None:
        self._disk.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        # In-place reload (vLLM's reload path): straight into the held views.
        self._disk.load_weights(model, model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        held = state.current()
        if held is not None:
            return held.nbytes
        # Asked before the model is built: a set the holder already holds (the warm start
        # attaches it) is on the device outside this process's budget, as vLLM's own IPC
        # loader counts its daemon's weights; without it the KV pool would be sized as if
        # that memory were free.
        return held_bytes(self.socket, _rank_key(self.model_digest, vllm_config))

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig,
                   prefix: str = "") -> nn.Module:
        import vllm

        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1 or par.data_parallel_size > 1:
            # The agent never asks for it then (agent/engines/vllm/parallel.py).
            raise ValueError(f"--load-format pitstop holds weights per tensor-parallel rank; "
                             f"this engine has pipeline-parallel size "
                             f"{par.pipeline_parallel_size} and data-parallel size "
                             f"{par.data_parallel_size}")
        # Each tensor-parallel worker holds its own shard, under a key of its own.
        self.digest = _rank_key(self.model_digest, vllm_config)
        load_device = vllm_config.load_config.device or vllm_config.device_config.device
        device = torch.device(load_device)
        t0 = time.monotonic()
        forget = _forgetter(vllm_config)
        with set_default_torch_dtype(model_config.dtype):
            # On the meta device: no memory, only what the model is made of.
            with torch.device("meta"):
                meta = initialize_model(vllm_config=vllm_config, model_config=model_config,
                                        prefix=prefix)
            methods = _rewriting_methods(meta)
            if not methods:
                del meta
                forget()
                model, held = self._load_bound(vllm_config, model_config, prefix, device,
                                               vllm.__version__)
            else:
                unfit = [f"{name or '<root>'}: {kind}" for name, kind, fit in methods
                         if not fit and kind not in ONLINE_RESTARTABLE]
                quant = type(vllm_config.quant_config).__name__
                sig = post.signature(meta, vllm.__version__, quant)
                if unfit:
                    del meta
                    forget()
                    model, held = self._load_once(vllm_config, model_config, prefix, device,
                                                  sig, unfit)
                else:
                    online = any(kind in ONLINE_RESTARTABLE for _, kind, _ in methods)
                    model, held = self._load_post(meta, vllm_config, model_config, prefix,
                                                  device, sig, forget, online)
        space = held.held.space
        keep: frozenset[str] = frozenset()
        if held.layout is not None:
            # Bound by parameter: vLLM's buffers (rotary tables) are made from the config
            # when the model is built, the same on every start; only parameters count.
            def check() -> list[str]:
                return held.outside(dict(model.named_parameters()))
        else:
            keep = post.pinned(model)
            if keep:
                log.info("pitstop loader: %d tensors stay in the engine's own memory (its "
                         "image), as native kernels hold their addresses: %s", len(keep),
                         ", ".join(sorted(keep)[:5]))

            def check() -> list[str]:
                return post.outside(model, space.base, space.size, keep)
        outside = check()
        if outside:
            log.warning("%d tensors the engine reads are outside held memory (%s): their "
                        "bytes are in the engine's image", len(outside), ", ".join(outside[:5]))
        state.set_current(held, source=held.source, seconds=time.monotonic() - t0,
                          outside=outside, check=check, in_image=sorted(keep))
        log.info("pitstop loader: %s, %.1f MB %s in %.2fs", held.source, held.nbytes / 1e6,
                 "attached" if held.source == "holder" else "loaded and held",
                 time.monotonic() - t0)
        return model.eval()

    def _load_bound(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                    device: torch.device, version: str) -> tuple[nn.Module, HeldParams]:
        """A model whose post-processing leaves its tensors where they are (unquantized,
        dense): its parameters are bound to held memory before vLLM loads into them."""
        with device, params_without_storage(device):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config,
                                     prefix=prefix)
        params = dict(model.named_parameters())
        return model, self._hold(model, params, model_config, device, version)

    def _load_post(self, meta: nn.Module, vllm_config: VllmConfig, model_config: ModelConfig,
                   prefix: str, device: torch.device, sig: str,
                   forget: Callable[[], None], online: bool) -> tuple[nn.Module, HeldParams]:
        """A model whose post-processing rewrites its tensors (quantized, mixture of
        experts): the holder keeps what vLLM made of the checkpoint. A warm start maps
        that and has vLLM only rebuild its Python-side state; a first start loads and
        post-processes as vLLM does (`online`: quantizing layer by layer as it loads,
        through vLLM's own loader), then moves every tensor into held memory."""
        name = f"{self.digest}/{support.POST_REGION}{sig}"
        held = HeldParams.attach(self.socket, self.digest, name, _space_factory(device))
        if held is not None:
            try:
                raw = held.raw()
                layout = post.Layout.read(raw)
                post.register(meta, raw, layout)
                _keep_weights_in_place(meta, device)
                with already_processed(True), online_done(meta):
                    process_weights_after_loading(meta, model_config, device)
                filled = post.fill_kernel_state(meta, layout.kernels)
                if filled:
                    log.info("warm start: %d kernel values the first start's post-processing "
                             "set were given back (%s)", len(filled), ", ".join(filled[:3]))
                left = post.materialize(meta, device)
                if left:
                    log.warning("warm start: %d tensors were not in the held set: %s",
                                len(left), ", ".join(left[:5]))
            except BaseException:
                held.close()
                raise
            return meta, held
        del meta
        forget()
        if online:
            return self._load_and_hold(vllm_config, model_config, prefix, device, name)
        with device:
            model = initialize_model(vllm_config=vllm_config, model_config=model_config,
                                     prefix=prefix)
        self._disk.load_weights(model, model_config)
        _keep_weights_in_place(model, device)
        process_weights_after_loading(model, model_config, device)
        return model, self._move_into_holder(model, name, device)

    def _load_once(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                   device: torch.device, sig: str,
                   unfit: list[str]) -> tuple[nn.Module, HeldParams]:
        """A model whose quantization methods cannot start from their own output (vLLM's
        `supports_pre_processed_weights` is false; its weight-cache daemon refuses them
        too): loaded by vLLM's own loader, online quantization included, then held as the
        post-processed path holds. The hybrid and refill rungs map those bytes back as they
        were; no start ever attaches them (the region's name says so, and the agent skips
        `warm`): each start loads from disk and holds its own, releasing the one before."""
        log.info("pitstop loader: %d layers' quantization methods cannot start from their own "
                 "output (%s): held for hybrid and refill restores, never attached by a new "
                 "start", len(unfit), "; ".join(unfit[:3]))
        return self._load_and_hold(vllm_config, model_config, prefix, device,
                                   f"{self.digest}/{support.ONCE_REGION}{sig}")

    def _load_and_hold(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                       device: torch.device, name: str) -> tuple[nn.Module, HeldParams]:
        """Loaded by vLLM's own loader (online quantization's layer-by-layer path
        included), then moved into the new held region `name`."""
        model = self._disk.load_model(vllm_config=vllm_config, model_config=model_config,
                                      prefix=prefix)
        return model, self._move_into_holder(model, name, device)

    def _move_into_holder(self, model: nn.Module, name: str,
                          device: torch.device) -> HeldParams:
        """Every tensor of a loaded, post-processed `model` moved into a new held region
        `name` (its header lays them out), committed; but those native kernels hold by
        address (`post.pinned`), which stay where they are."""
        layout = post.Layout.of(model, post.pinned(model))
        held = HeldParams.create(self.socket, self.digest, name, layout.size,
                                 _space_factory(device))
        try:
            post.move(model, held.raw(), layout)
            held.commit()
        except BaseException:
            held.close()
            raise
        return held

    def _hold(self, model: nn.Module, params: dict[str, Any], model_config: ModelConfig,
              device: torch.device, version: str) -> HeldParams:
        """Make the held set the parameters' storage: attached when the holder has it (a
        warm start), else made, filled by vLLM's weight loaders and committed."""
        specs = specs_of(params)
        # The parameters' own storage (the small ones', and the scratch the big ones were
        # views of) goes back before the holder allocates the set. vLLM's sleep-mode pool
        # keeps the freed blocks until the load ends (it trims them then; trimming earlier
        # would let torch hand out unmapped memory), but they are only the scratch and one
        # block per parameter size, never the weights.
        give_back_storage(params)
        held = HeldParams.open(self.socket, self.digest, specs, version, _space_factory(device))
        try:
            held.bind(params)
            if held.source == "disk":
                self._disk.load_weights(model, model_config)
            _keep_weights_in_place(model, device)
            # Attached, the held bytes went through vLLM's post-processing on the start that
            # made them: vLLM then only rebuilds its Python-side state (as over its own
            # weight-cache daemon's tensors), never transforms them a second time.
            with already_processed(held.source == "holder"):
                process_weights_after_loading(model, model_config, device)
            if held.source == "disk":
                held.commit()
            held.record_layout()
        except BaseException:
            held.close()
            raise
        return held


def _rank_key(digest: str, vllm_config: VllmConfig) -> str:
    """What this worker's weights are held under (support.held_key): `digest` itself for
    one worker, one key per rank of a tensor-parallel engine."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp == 1:
        return digest
    from vllm.distributed import get_tensor_model_parallel_rank

    return held_key(digest, tp, get_tensor_model_parallel_rank())


def _space_factory(device: torch.device) -> Any:
    if device.type == "cuda":
        from agent.tenant.mapping_cuda import cuda_space_factory

        return cuda_space_factory(device.index if device.index is not None
                                  else torch.cuda.current_device())
    from agent.tenant.mapping import HostSpace

    return HostSpace


def _keep_weights_in_place(model: nn.Module, device: torch.device) -> None:
    """On CPU, vLLM repacks each linear weight for oneDNN into memory of its own and drops
    the parameter: the held weights would then be a copy nobody reads, and the weights
    would be in the image after all. Its own opt-out (set for MLA's kv_b_proj) keeps
    torch's linear over the parameter itself."""
    if device.type != "cpu":
        return
    from vllm.model_executor.layers.linear import LinearBase

    for m in model.modules():
        if isinstance(m, LinearBase):
            m._cpu_skip_gemm_dispatch = True


def _rewriting_methods(model: nn.Module) -> list[tuple[str, str, bool]]:
    """The layers whose method may rewrite their tensors after loading (any quantization
    method, mixture-of-experts), each with whether it can start from its own output."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    plain = {UnquantizedLinearMethod.__name__, "UnquantizedEmbeddingMethod"}
    found = []
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and type(qm).__name__ not in plain:
            found.append((name, type(qm).__name__,
                          bool(getattr(qm, "supports_pre_processed_weights", False))))
    return found


def _forgetter(vllm_config: VllmConfig) -> Callable[[], None]:
    from vllm.model_executor.layers import rotary_embedding

    return registry.forgetter(vllm_config.compilation_config,
                              getattr(rotary_embedding, "_ROPE_DICT", None))
