"""The vLLM internals the Pitstop plugin uses, and whether an installed vLLM has each.

Read from vLLM's own source files, never by importing it (torch and vLLM take seconds to
import, and an API server that imported vLLM's worker would carry it into every image):
the agent checks the engine's vLLM before it adds `--load-format pitstop`, the plugin
checks the vLLM it runs in before it registers. Stdlib only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class Kind(StrEnum):
    FUNCTION = "function"  # a top-level def, with these parameters
    CLASS = "class"        # a top-level class, with these methods or fields of its own
    TEXT = "text"          # this text in the module (or anywhere in the package)


@dataclass(frozen=True)
class Need:
    """One internal of vLLM that the plugin relies on.

    Example::

        Need("registering --load-format pitstop", "vllm.model_executor.model_loader",
             "register_model_loader", Kind.FUNCTION, ("load_format",))
    """

    what: str
    module: str
    name: str
    kind: Kind
    members: tuple[str, ...] = ()
    builds: frozenset[str] = frozenset({"cpu", "cuda"})

    def describe(self) -> str:
        if self.kind is Kind.TEXT:
            return f"{self.name!r} in {self.module}"
        inner = f"({', '.join(self.members)})" if self.members else ""
        return f"{self.module}.{self.name}{inner}"


CUDA = frozenset({"cuda"})
CPU = frozenset({"cpu"})
LOADER = "vllm.model_executor.model_loader"

NEEDS: tuple[Need, ...] = (
    Need("registering --load-format pitstop", LOADER, "register_model_loader", Kind.FUNCTION,
         ("load_format",)),
    Need("the model loader's base class", f"{LOADER}.base_loader", "BaseModelLoader",
         Kind.CLASS, ("load_model", "load_weights", "download_model")),
    Need("vLLM's weight loaders filling held memory from disk", f"{LOADER}.default_loader",
         "DefaultModelLoader", Kind.CLASS, ("load_weights", "download_model")),
    Need("building the model as vLLM does", f"{LOADER}.utils", "initialize_model",
         Kind.FUNCTION, ("vllm_config", "model_config", "prefix")),
    Need("vLLM's post-processing of loaded weights", f"{LOADER}.utils",
         "process_weights_after_loading", Kind.FUNCTION,
         ("model", "model_config", "target_device")),
    Need("the loader's settings (--load-format, --model-loader-extra-config)",
         "vllm.config.load", "LoadConfig", Kind.CLASS,
         ("load_format", "model_loader_extra_config", "device")),
    Need("the model's dtype while it is built", "vllm.utils.torch_utils",
         "set_default_torch_dtype", Kind.FUNCTION, ("dtype",)),
    Need("--worker-extension-cls and one worker", "vllm.config.parallel", "ParallelConfig",
         Kind.CLASS, ("worker_extension_cls", "world_size")),
    Need("the worker extension's calls (/collective_rpc, VLLM_SERVER_DEV_MODE)",
         "vllm.entrypoints", '"/collective_rpc"', Kind.TEXT),
    Need("sleep mode, which releases the KV pool before a checkpoint",
         "vllm.v1.worker.gpu_worker", "Worker", Kind.CLASS, ("sleep", "wake_up"), CUDA),
    Need("sleep mode's allocator (--enable-sleep-mode)", "vllm.device_allocator.cumem",
         "CuMemAllocator", Kind.CLASS, ("sleep", "wake_up", "use_memory_pool"), CUDA),
    Need("--enable-sleep-mode", "vllm.config.model", "ModelConfig", Kind.CLASS,
         ("enable_sleep_mode",), CUDA),
    Need("linear layers that read held weights, not oneDNN's repacked copy",
         "vllm.model_executor.layers.linear", "_cpu_skip_gemm_dispatch", Kind.TEXT,
         builds=CPU),
    Need("the CPU KV pool, dropped before a checkpoint", "vllm.v1.worker.gpu_model_runner",
         "self.kv_caches", Kind.TEXT, builds=CPU),
)


@dataclass(frozen=True)
class Missing:
    need: Need
    why: str

    def describe(self) -> str:
        return f"{self.need.describe()} ({self.need.what}): {self.why}"


def missing(root: Path, build: str, needs: Iterable[Need] | None = None) -> list[Missing]:
    """The needs of `build` ("cpu" or "cuda") that the vLLM package at `root` lacks.

    Example::

        missing(Path(".../site-packages/vllm"), "cuda")   # [] when the plugin can run
    """
    return [m for n in (NEEDS if needs is None else needs) if build in n.builds
            for m in [_check(root, n)] if m is not None]


def describe(found: list[Missing]) -> str:
    return "; ".join(m.describe() for m in found)


def _check(root: Path, need: Need) -> Missing | None:
    rel = Path(*need.module.split(".")[1:])
    if need.kind is Kind.TEXT and (root / rel).is_dir():
        hit = any(need.name in _text(p) for p in sorted((root / rel).rglob("*.py")))
        return None if hit else Missing(need, "not found in the package")
    path = next((p for p in (root / rel.with_suffix(".py"), root / rel / "__init__.py")
                 if p.is_file()), None)
    if path is None:
        return Missing(need, "the module is not there")
    text = _text(path)
    if need.kind is Kind.TEXT:
        return None if need.name in text else Missing(need, "not found in the module")
    if need.kind is Kind.FUNCTION:
        m = re.search(rf"^(?:async\s+)?def {re.escape(need.name)}\((.*?)\)\s*(?:->[^\n]*)?:\s*$",
                      text, re.MULTILINE | re.DOTALL)
        if m is None:
            return Missing(need, "no such function")
        params = set(re.findall(r"(?:^|[(,\s*])(\w+)\s*(?=[:=,)]|$)", m.group(1)))
        absent = [p for p in need.members if p not in params]
        return Missing(need, f"it takes no {', '.join(absent)}") if absent else None
    body = _class_body(text, need.name)
    if body is None:
        return Missing(need, "no such class")
    absent = [m for m in need.members if not re.search(
        rf"^\s+(?:(?:async\s+)?def {re.escape(m)}\(|{re.escape(m)}\s*[:=])", body,
        re.MULTILINE)]
    return Missing(need, f"it has no {', '.join(absent)}") if absent else None


def _class_body(text: str, name: str) -> str | None:
    m = re.search(rf"^class {re.escape(name)}\b[^\n]*$", text, re.MULTILINE)
    if m is None:
        return None
    # The class ends at the next statement at column 0 (a comment there does not end it).
    end = re.search(r"^(?=[^\s#])", text[m.end() + 1:], re.MULTILINE)
    return text[m.end():m.end() + 1 + end.start()] if end else text[m.end():]


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
