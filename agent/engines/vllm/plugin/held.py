"""vLLM's model parameters in one held region: laid out by name, bound in place, detached."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import HolderError, MappingError
from agent.holder.client import HolderClient
from agent.holder.paramlayout import ParamLayout, ParamSlot, write_layout
from agent.tenant.mapping import HeldSet, HostSpace, Space

# Under vLLM's logger: its handlers print it with the process name, like its own lines.
log = logging.getLogger("vllm.pitstop")

# Every parameter starts on this boundary: enough for any dtype and for vectorised kernels.
ALIGN = 256


# A parameter's dtype and shape: what its slot must hold, known before any storage exists.
Spec = tuple[Any, tuple[int, ...]]


def specs_of(params: dict[str, Any]) -> dict[str, Spec]:
    return {n: (p.dtype, tuple(p.shape)) for n, p in params.items()}


def give_back_storage(params: dict[str, Any]) -> None:
    """Empty every parameter (dtype kept, no bytes; the Parameter objects stay for bind()),
    before anything was loaded into them. On CUDA the memory goes back to the driver: vLLM's
    sleep-mode allocator releases a freed block at once, torch's own cache is emptied."""
    import torch

    cuda = False
    for p in params.values():
        cuda = cuda or p.device.type == "cuda"
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    if cuda:
        torch.cuda.empty_cache()


# A parameter at least this big gives its storage back as it is registered.
MIN_SWAP_BYTES = 1 << 20


@contextlib.contextmanager
def params_without_storage(device: Any) -> Iterator[None]:
    """While vLLM builds the model, every parameter of MIN_SWAP_BYTES or more on `device`'s
    kind gives its own storage back the moment it is registered and becomes a view of one
    scratch buffer (contiguous and writable: model code that writes an initial value still
    can), the size of the largest parameter. So the model's weights never exist on the
    device before the held set does: the holder allocates them once.

    Example::

        with torch.device("cuda:0"), params_without_storage(torch.device("cuda:0")):
            model = initialize_model(vllm_config=cfg, model_config=mcfg)
        # every big parameter's .data is a view of the scratch, dtype and shape kept
    """
    import torch
    from torch.nn.modules.module import register_module_parameter_registration_hook
    from torch.nn.parameter import is_lazy

    views: list[Any] = []  # the parameters made views so far, to move to a bigger scratch
    scratch: list[Any] = []

    def view(param: Any, buf: Any) -> None:
        param.data = buf[:param.nbytes].view(param.dtype).view(param.shape)

    def hook(module: Any, name: str, param: Any) -> None:
        if (param is None or is_lazy(param) or param.device.type != device.type
                or param.nbytes < MIN_SWAP_BYTES):
            return
        if not scratch or scratch[0].numel() < param.nbytes:
            # Every earlier view moves over, so only one scratch is ever alive.
            scratch[:] = [torch.empty(param.nbytes, dtype=torch.uint8, device=param.device)]
            for p in views:
                view(p, scratch[0])
        view(param, scratch[0])
        views.append(param)

    handle = register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        views.clear()
        scratch.clear()


def held_bytes(socket: Path, digest: str) -> int:
    """The bytes of vLLM parameters the holder at `socket` holds committed for `digest`
    (0 when none, or when it does not answer)."""
    try:
        with HolderClient(socket, timeout=5.0) as c:
            regions = c.committed_set(digest) or []
    except (HolderError, OSError):
        return 0
    return sum(r.size for r in regions if r.name.startswith(f"{digest}/vllm-params-"))


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the region, and what it is."""

    name: str
    offset: int
    nbytes: int
    dtype: Any
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The model's unique parameters back to back, sorted by name, and what fixes it."""

    slots: tuple[Slot, ...]
    size: int
    # Names, dtypes and shapes (and vLLM's version): a set held under another signature was
    # laid out for another model build and is never mapped as this one.
    signature: str

    @classmethod
    def of(cls, specs: dict[str, Spec], vllm_version: str) -> Layout:
        slots, at, h = [], 0, hashlib.sha256(vllm_version.encode())
        for name in sorted(specs):
            dtype, shape = specs[name]
            at = -(-at // ALIGN) * ALIGN
            n = math.prod(shape) * dtype.itemsize
            slots.append(Slot(name, at, n, dtype, shape))
            h.update(f"\n{name} {dtype} {shape}".encode())
            at += n
        return cls(tuple(slots), max(at, ALIGN), h.hexdigest()[:16])

    def region(self, digest: str) -> str:
        return f"{digest}/vllm-params-{self.signature}"


class HeldParams:
    """The parameters of one vLLM model, living in the holder and mapped into this worker.

    Example::

        held = HeldParams.open(sock, digest, specs_of(params), version, HostSpace)
        held.bind(params)        # every parameter's .data is now a view over held memory
        if held.source == "disk":
            ...                  # vLLM's weight loaders fill the views; then held.commit()
        held.detach()            # before a checkpoint: unmapped, the addresses kept
        held.reattach()          # after the restore: same regions, same addresses
    """

    def __init__(self, socket: Path, digest: str, layout: Layout | None, held: HeldSet,
                 source: str, writer: HolderClient | None, region: str = "",
                 size: int = 0) -> None:
        self.socket = socket
        self.digest = digest
        # The parameters' slots, when bound before loading (bind()); None when the region
        # holds what vLLM's post-processing made (agent/engines/vllm/plugin/post.py).
        self.layout = layout
        self.region = region or (layout.region(digest) if layout else "")
        self.size = size or (layout.size if layout else 0)
        self.held = held
        # "holder": attached a committed set (a warm start); "disk": made here, to be filled.
        self.source = source
        self._writer = writer

    @classmethod
    def open(cls, socket: Path, digest: str, specs: dict[str, Spec], vllm_version: str,
             make_space: Callable[[int, int], Space] = HostSpace) -> HeldParams:
        """Attach the committed set of `digest` laid out as `specs` say, or make a new one.

        A committed set of `digest` under another layout (vLLM upgraded, another dtype) is
        released first: the holder keeps one set per digest, and this engine's is the one
        the agent will restore against.
        """
        layout = Layout.of(specs, vllm_version)
        held = cls.attach(socket, digest, layout.region(digest), make_space)
        if held is not None:
            held.layout = layout
            return held
        return cls.create(socket, digest, layout.region(digest), layout.size, make_space,
                          layout)

    @classmethod
    def attach(cls, socket: Path, digest: str, name: str,
               make_space: Callable[[int, int], Space] = HostSpace) -> HeldParams | None:
        """The committed set of `digest` when it is exactly the region `name`, mapped; else
        None."""
        with HolderClient(socket) as client:
            regions = client.committed_set(digest)
            if regions is None or [r.name for r in regions] != [name]:
                return None
            held = HeldSet.attach(client, digest, make_space, by_digest=True)
        log.info("attached held weights %s (%.1f MB): nothing read from disk", name,
                 regions[0].size / 1e6)
        return cls(socket, digest, None, held, "holder", None, name, regions[0].size)

    @classmethod
    def create(cls, socket: Path, digest: str, name: str, size: int,
               make_space: Callable[[int, int], Space] = HostSpace,
               layout: Layout | None = None) -> HeldParams:
        """A new region `name` of `size` bytes for `digest`, to be filled then committed;
        any committed set of `digest` under another name is released first."""
        client = HolderClient(socket)
        try:
            for r in client.list(digest):
                if r.committed:
                    log.warning("releasing held region %s: this engine lays its weights out "
                                "as %s", r.name, name)
                    client.release(r.name)
            # The name fixes the bytes (digest and layout): a restored engine re-attaches
            # the same name from another holder or epoch, e.g. one refilled from a copy.
            held = HeldSet.create(client, digest, {name: size}, make_space, by_digest=True)
        except BaseException:
            client.close()
            raise
        # The session stays open until commit: should this worker die first, the holder
        # frees the half-written region and nobody ever maps it.
        return cls(socket, digest, layout, held, "disk", client, name, size)

    def raw(self) -> Any:
        """The region as one uint8 tensor over held memory."""
        return self.held.tensor(self.region)

    def bind(self, params: dict[str, Any]) -> None:
        """Make each parameter's storage its slot in held memory (the Parameter objects,
        and so vLLM's weight-loader attributes on them, stay). The slot says the dtype and
        shape: a parameter whose own storage was already given back has neither."""
        assert self.layout is not None, "bind() is for a set laid out by parameter"
        raw = self.raw()
        for s in self.layout.slots:
            # Attached: the held bytes are the loaded weights already. Made here: vLLM's
            # weight loaders copy into .data, so they fill held memory in place.
            params[s.name].data = raw[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)

    def commit(self) -> None:
        if self._writer is None:
            raise MappingError("commit() is for a set made by this worker")
        try:
            self.held.commit()
        finally:
            self._writer.close()
            self._writer = None
        log.info("held weights %s committed (%.1f MB)", self.region, self.size / 1e6)

    def record_layout(self) -> None:
        """Leave where each parameter lies in the region beside the holder's socket: the
        agent's refill recipe finds each checkpoint tensor's bytes in its parameter's slot.
        A layout that cannot be written costs that recipe only (the agent says so)."""
        if self.layout is None:
            return  # a post-processed set (quantized, MoE): not the files' bytes relaid
        layout = ParamLayout(self.layout.region(self.digest), self.layout.size,
                             tuple(ParamSlot(s.name, s.offset, s.nbytes)
                                   for s in self.layout.slots))
        try:
            write_layout(self.socket.parent, layout)
        except OSError as e:
            log.warning("the layout of held weights %s was not written: %s", layout.region, e)

    def close(self) -> None:
        """Unmap everything; an uncommitted set is freed by the holder with our session."""
        try:
            self.held.close()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def outside(self, params: dict[str, Any]) -> list[str]:
        """Parameters whose storage is no longer in held memory (vLLM post-processing
        replaced it): those bytes are in the process, and so in a hybrid image."""
        base = self.held.space.base
        end = base + self.held.space.size
        return [n for n, p in params.items()
                if p.numel() and not (base <= p.data_ptr() < end)]

    @property
    def attached(self) -> bool:
        return self.held.attached

    @property
    def nbytes(self) -> int:
        return self.size

    @property
    def identity(self) -> dict[str, dict[str, object]]:
        return self.held.identity

    def detach(self) -> None:
        """Unmap the weights, keep the addresses: nothing may run until reattach."""
        self.held.detach()

    def reattach(self) -> None:
        """Map the same regions at the same addresses; MappingError if they changed."""
        with HolderClient(self.socket) as client:
            self.held.reattach(client)
