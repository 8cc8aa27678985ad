"""Every child process of the agent starts through agent/commands.py or a named long-lived
spawner that owns its child: a subreaper's orphan reaper must never take an exit status."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parent.parent / "agent"

# Modules allowed to start processes themselves, and why.
SPAWNERS = {
    "commands.py": "the one runner",
    "supervisor/engine.py": "the engine: long-lived, watched through a pidfd",
    "supervisor/ownership.py": "the tether: long-lived, outside the engine tree",
    # These two never run inside the agent's (subreaper) process.
    "engines/vllm/preload.py": "`pitstop vllm-preload`: the daemon's own unit process",
    "units.py": "`pitstop install-units`: a command run once by an operator",
    "checkpoint/nsinit.py": "the standby's namespace init: its own process, started as an engine",
    "deathsig.py": "the engine's small root (`--root`): a script of its own that forks the engine",
}
# Inside the agent a long-lived spawner must hold the spawn lock while it forks, so that
# the reaper never sees its child as an orphan.
IN_AGENT = ("commands.py", "supervisor/engine.py", "supervisor/ownership.py")
STARTERS = {("subprocess", n) for n in ("run", "Popen", "call", "check_call", "check_output",
                                       "getoutput", "getstatusoutput")}
STARTERS |= {("os", n) for n in ("system", "popen", "fork", "forkpty", "posix_spawn",
                                "posix_spawnp", "spawnv", "spawnl", "spawnvp", "spawnlp")}
STARTERS |= {("asyncio", "create_subprocess_exec"), ("asyncio", "create_subprocess_shell"),
             ("pty", "fork"), ("pty", "spawn")}


def _starts(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every use of a process starter, however the module names it: `subprocess.Popen`,
    through an alias (`import subprocess as sp`), imported by name (`from subprocess import
    Popen`), called or handed on (`run_in_executor(None, subprocess.run, ...)`)."""
    modules: dict[str, str] = {}  # a name bound by `import`: the module it is
    imported: dict[str, tuple[str, str]] = {}  # a name bound by `from m import n`: (m, n)
    found: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else \
                    a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                imported[a.asname or a.name] = (node.module, a.name)
                if (node.module, a.name) in STARTERS:
                    found.append((node, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and (modules.get(node.value.id), node.attr) in STARTERS:
            found.append((node, f"{modules[node.value.id]}.{node.attr}"))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                and imported.get(node.id) in STARTERS:
            module, name = imported[node.id]
            found.append((node, f"{module}.{name}"))
    return found


def _under_the_spawn_lock(tree: ast.AST) -> set[int]:
    """The nodes inside a `with proc.spawn_lock():` (or `with spawn_lock():`) block."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With | ast.AsyncWith) and any(
                isinstance(i.context_expr, ast.Call) and (
                    getattr(i.context_expr.func, "attr", None) == "spawn_lock"
                    or getattr(i.context_expr.func, "id", None) == "spawn_lock")
                for i in node.items):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def test_no_module_starts_a_process_outside_the_runner_and_the_named_spawners():
    offenders = []
    for path in sorted(AGENT.rglob("*.py")):
        rel = path.relative_to(AGENT).as_posix()
        if rel in SPAWNERS:
            continue
        for node, call in _starts(ast.parse(path.read_text(), str(path))):
            offenders.append(f"agent/{rel}:{getattr(node, 'lineno', '?')}: {call}")
    assert offenders == [], ("start these through agent.commands.run (or add a spawner "
                             "here with the reason): " + ", ".join(offenders))


def test_the_spawners_inside_the_agent_fork_under_the_spawn_lock():
    for rel in IN_AGENT:
        tree = ast.parse((AGENT / rel).read_text())
        # Each use, not the import that names it.
        starts = [(n, call) for n, call in _starts(tree) if not isinstance(n, ast.ImportFrom)]
        assert starts, f"agent/{rel} no longer starts anything: drop it"
        locked = _under_the_spawn_lock(tree)
        outside = [f"agent/{rel}:{node.lineno}: {call}" for node, call in starts  # type: ignore[attr-defined]
                   if id(node) not in locked]
        assert outside == [], f"forks without holding proc.spawn_lock(): {outside}"


def test_the_checks_see_every_way_of_naming_a_starter():
    tree = ast.parse("import subprocess as sp, os.path\nfrom subprocess import Popen as P\n"
                     "from asyncio import create_subprocess_exec\n"
                     "sp.run(['a'])\nos.fork()\nP(['b'])\nrun_in_executor(None, sp.check_call)\n"
                     "# subprocess.Popen in a comment, and spawn_lock()\n"
                     "with proc.spawn_lock():\n    sp.Popen(['c'])\n")
    starts = _starts(tree)
    assert sorted((getattr(n, "lineno", 0), c) for n, c in starts) == [
        (2, "from subprocess import Popen"), (3, "from asyncio import create_subprocess_exec"),
        (4, "subprocess.run"), (5, "os.fork"), (6, "subprocess.Popen"),
        (7, "subprocess.check_call"), (10, "subprocess.Popen")]
    locked = _under_the_spawn_lock(tree)
    assert [getattr(n, "lineno", 0) for n, _ in starts if id(n) in locked] == [10]


def test_every_named_spawner_exists():
    assert [r for r in SPAWNERS if not (AGENT / r).is_file()] == []
