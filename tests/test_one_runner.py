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
}
# Inside the agent a long-lived spawner must hold the spawn lock while it forks, so that
# the reaper never sees its child as an orphan.
IN_AGENT = ("commands.py", "supervisor/engine.py", "supervisor/ownership.py")
STARTERS = {("subprocess", n) for n in ("run", "Popen", "call", "check_call", "check_output",
                                       "getoutput", "getstatusoutput")}
STARTERS |= {("os", n) for n in ("system", "popen", "fork", "forkpty", "posix_spawn",
                                "posix_spawnp", "spawnv", "spawnl", "spawnvp", "spawnlp")}


def _starts(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in STARTERS):
            found.append((node.lineno, f"{node.func.value.id}.{node.func.attr}"))
    return found


def test_no_module_starts_a_process_outside_the_runner_and_the_named_spawners():
    offenders = []
    for path in sorted(AGENT.rglob("*.py")):
        rel = path.relative_to(AGENT).as_posix()
        if rel in SPAWNERS:
            continue
        for line, call in _starts(ast.parse(path.read_text(), str(path))):
            offenders.append(f"agent/{rel}:{line}: {call}")
    assert offenders == [], ("start these through agent.commands.run (or add a spawner "
                             "here with the reason): " + ", ".join(offenders))


def test_the_spawners_inside_the_agent_fork_under_the_spawn_lock():
    for rel in IN_AGENT:
        text = (AGENT / rel).read_text()
        assert _starts(ast.parse(text)), f"agent/{rel} no longer starts anything: drop it"
        assert "spawn_lock()" in text, f"agent/{rel} forks without proc.spawn_lock()"


def test_every_named_spawner_exists():
    assert [r for r in SPAWNERS if not (AGENT / r).is_file()] == []
