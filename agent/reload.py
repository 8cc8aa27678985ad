"""The reload policy: for each configuration key, whether a running agent applies a change."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ValidationError

from agent.config import Config
from agent.errors import ConfigError


class Apply(StrEnum):
    """What a reload does with a changed key."""

    # In effect from its next use (the next health check, capture, prune, ladder walk).
    LIVE = "live"
    # In effect once the engine is replaced through the ladder, which the reload asks for.
    ENGINE = "engine"
    # Refused: the running value stays until `systemctl restart pitstop-agent`.
    RESTART = "restart"


# Every key of agent/config.py, once (tests/test_reload.py fails on a key missing here):
# how a reload treats a change of it, and why, in words for the docs and the refusal.
POLICY: dict[str, tuple[Apply, str]] = {
    "engine.kind": (Apply.RESTART, "the adapter and the ladder are built for one engine kind; "
                                   "the whole reload is refused"),
    "engine.model": (Apply.ENGINE, "the engine is replaced"),
    "engine.served_model_name": (Apply.ENGINE, "the engine is replaced"),
    "engine.socket": (Apply.RESTART, "the front, the capture and the restore rungs connect to "
                                     "the socket they were built with"),
    "engine.device": (Apply.RESTART, "the GPU fault watch is chosen at start"),
    "engine.python": (Apply.RESTART, "the engine's features and versions are read from its "
                                     "interpreter at start"),
    "engine.env": (Apply.RESTART, "the GPU the agent watches (CUDA_VISIBLE_DEVICES) and "
                                  "vLLM's features are read at start"),
    "engine.args": (Apply.ENGINE, "the engine is replaced"),
    "engine.stop_timeout_s": (Apply.LIVE, "the next engine stop"),
    "engine.small_root": (Apply.LIVE, "the next cold start (a restored engine keeps the root "
                          "its snapshot holds)"),
    "front.enabled": (Apply.RESTART, "the front owns the public port from the agent's start"),
    "front.host": (Apply.RESTART, "the front's socket is bound at start"),
    "front.port": (Apply.RESTART, "the front's socket is bound at start"),
    "front.queue.max_waiting": (Apply.LIVE, "the next request held"),
    "front.queue.deadline_s": (Apply.LIVE, "the next request held"),
    "front.queue.retry_after_s": (Apply.LIVE, "the next refusal"),
    "front.max_resumes": (Apply.LIVE, "the next resumed answer"),
    "front.resume_wait_s": (Apply.LIVE, "the next resumed answer"),
    "front.max_body_bytes": (Apply.RESTART, "the HTTP server's body limit is set at start"),
    "front.body_timeout_s": (Apply.LIVE, "the next request"),
    "front.api_key_file": (Apply.LIVE, "read again on every reload, changed or not: the next "
                                       "request; requests already admitted go on"),
    "front.tls.cert_file": (Apply.LIVE, "read again on every reload, changed or not: the next "
                                        "TLS handshake, open connections keep theirs (set or "
                                        "unset: refused, TLS is on or off from the start)"),
    "front.tls.key_file": (Apply.LIVE, "read again on every reload, changed or not: the next "
                                       "TLS handshake, open connections keep theirs (set or "
                                       "unset: refused, TLS is on or off from the start)"),
    "front.tls.client_ca_file": (Apply.LIVE, "read again on every reload, changed or not: the "
                                             "next TLS handshake (set or unset: refused, client "
                                             "certificates are asked for from the start)"),
    "paths.state_dir": (Apply.RESTART, "the agent holds its lock and ledger there"),
    "paths.snapshot_dir": (Apply.RESTART, "the snapshot store is opened at start"),
    "paths.run_dir": (Apply.RESTART, "the control socket and status file live there"),
    "health.interval_s": (Apply.LIVE, "the next health check"),
    "health.timeout_s": (Apply.LIVE, "the next health check and restore"),
    "health.failures_before_restart": (Apply.LIVE, "the next health check"),
    "health.start_timeout_s": (Apply.LIVE, "the next start"),
    "health.canary.prompt": (Apply.LIVE, "the next start records its answer"),
    "health.canary.max_tokens": (Apply.LIVE, "the next start records its answer"),
    "restart.backoff_initial_s": (Apply.LIVE, "the next backoff"),
    "restart.backoff_max_s": (Apply.LIVE, "the next backoff"),
    "restart.backoff_multiplier": (Apply.LIVE, "the next backoff"),
    "restart.crash_loop_limit": (Apply.LIVE, "the next backoff"),
    "restart.crash_loop_window_s": (Apply.LIVE, "the next backoff"),
    "metrics.enabled": (Apply.RESTART, "the metrics endpoint is started at start"),
    "metrics.host": (Apply.RESTART, "the metrics endpoint is bound at start"),
    "metrics.port": (Apply.RESTART, "the metrics endpoint is bound at start"),
    "metrics.web_config_file": (Apply.LIVE, "read again on every reload, changed or not: the "
                                            "next scrape and TLS handshake (set or unset, or "
                                            "TLS added or removed in it: refused until a "
                                            "restart)"),
    "snapshots.enabled": (Apply.RESTART, "the snapshotter and its rungs are built at start"),
    "snapshots.backend": (Apply.RESTART, "the ladder's rungs are chosen at start"),
    "snapshots.regenerate": (Apply.LIVE, "the next start without a usable snapshot"),
    "snapshots.quiet_timeout_s": (Apply.LIVE, "the next capture"),
    "snapshots.drift_check_interval_s": (Apply.LIVE, "the next drift check (0 stops them)"),
    "snapshots.verify": (Apply.LIVE, "the next restore"),
    "snapshots.criu": (Apply.RESTART, "CRIU is located and its version recorded at start"),
    "snapshots.keep": (Apply.LIVE, "the next prune (after the next capture)"),
    "snapshots.disk_budget_gib": (Apply.LIVE, "the next prune (after the next capture)"),
    "snapshots.quarantine_keep": (Apply.LIVE, "the next quarantine or prune"),
    "snapshots.cuda_lock_timeout_ms": (Apply.LIVE, "the next capture"),
    "snapshots.restore_log_level": (Apply.LIVE, "the next restore"),
    "snapshots.remote": (Apply.LIVE, "the next ladder walk (pull) or capture (push)"),
    "snapshots.publish": (Apply.LIVE, "the next capture"),
    "snapshots.pull_timeout_s": (Apply.LIVE, "the next pull"),
    "snapshots.standby": (Apply.RESTART, "the standby rung is built, or left out, at start"),
    "snapshots.standby_woken": (Apply.RESTART, "the standby rung is built at start"),
    "holder.enabled": (Apply.LIVE, "the next ladder walk"),
    "holder.refill": (Apply.LIVE, "the next ladder walk"),
    "holder.dir": (Apply.RESTART, "the serving engine and its hybrid snapshots map the "
                                  "holder found at start"),
    "holder.gpu": (Apply.RESTART, "the serving engine and its hybrid snapshots map the holder "
                                  "found at start"),
    "vllm.snapshot.model": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.snapshot.revision": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.snapshot.port": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.snapshot.cuda_plugin_dir": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.snapshot.timeout_s": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.preload.enabled": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.preload.socket_dir": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.preload.health_port": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.preload.args": (Apply.RESTART, "vLLM's rungs are built at start"),
    "vllm.plugin.untested": (Apply.LIVE, "the next ladder walk"),
}

# Keys that apply live, except a change that turns them on or off (set <-> unset): a port
# serves TLS, or asks for client certificates, from its start.
SET_AT_START: dict[str, str] = {
    "front.tls.cert_file": "TLS on the front is turned on or off only at start",
    "front.tls.key_file": "TLS on the front is turned on or off only at start",
    "front.tls.client_ca_file": "client certificates are asked for or not from the start",
    "metrics.web_config_file": "the metrics endpoint's web configuration is taken up or "
                               "dropped only at start",
}

# A change of this key makes every other change meaningless for the running agent.
WHOLE_RELOAD_KEY = "engine.kind"
RESTART_HINT = "needs a restart of the agent (systemctl restart pitstop-agent)"


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every leaf key of the configuration, dotted (`front.queue.max_waiting`)."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            keys.extend(config_keys(kind, f"{prefix}{name}."))
        else:
            keys.append(prefix + name)
    return keys


def _get(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        data = data[part]
    data[leaf] = value


def changed_keys(old: Config, new: Config) -> list[str]:
    """The leaf keys whose values differ, in the order of config_keys()."""
    a, b = old.model_dump(), new.model_dump()
    return [k for k in config_keys() if _get(a, k) != _get(b, k)]


@dataclass(frozen=True)
class RefusedKey:
    """A changed key the running agent keeps its old value of, and why."""

    key: str
    why: str

    def __str__(self) -> str:
        return f"{self.key} ({self.why})"


@dataclass(frozen=True)
class ReloadResult:
    """What one reload did: the keys applied, the keys refused, or why none were read.

    Example::

        effective, result = plan(running, load_config(path), str(path))
        result.refused  # (RefusedKey('holder.dir', '...'),): kept at the running value
    """

    source: str
    at: float
    applied: tuple[str, ...] = ()
    refused: tuple[RefusedKey, ...] = ()
    # Whether an applied key replaces the engine (the ladder walks again, cause `reload`).
    engine_restart: bool = False
    # Set when the file could not be used at all (unreadable, invalid): nothing was applied.
    error: str = ""

    def summary(self) -> str:
        """One line for the log and systemd's status text."""
        if self.error:
            return f"reload refused, keeping the running configuration: {self.error}"
        if not self.applied and not self.refused:
            return f"configuration reloaded from {self.source}: nothing changed"
        parts = []
        if self.applied:
            parts.append("applied " + ", ".join(self.applied)
                         + (" (the engine is replaced)" if self.engine_restart else ""))
        if self.refused:
            parts.append(f"refused, {RESTART_HINT}: " + ", ".join(r.key for r in self.refused))
        return f"configuration reloaded from {self.source}: " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def failed(source: str, error: str) -> ReloadResult:
    """A reload that applied nothing: the file could not be read or validated."""
    return ReloadResult(source=source, at=time.time(), error=error)


def plan(old: Config, new: Config, source: str) -> tuple[Config, ReloadResult]:
    """The configuration now in effect (new values for the keys applied, running values for
    the keys refused) and the report of what was done.

    Raises ConfigError when the applied keys and the kept values of the refused ones do not
    make a valid configuration together (a cross-section check fails): then nothing applies.
    """
    changed = changed_keys(old, new)
    whole = WHOLE_RELOAD_KEY in changed
    refused, applied = [], []
    running, merged = old.model_dump(), new.model_dump()
    for key in changed:
        how, why = POLICY[key]
        if whole:
            refused.append(RefusedKey(key, why if key == WHOLE_RELOAD_KEY else
                                      f"{WHOLE_RELOAD_KEY} changed too"))
        elif how is Apply.RESTART:
            refused.append(RefusedKey(key, why))
        elif key in SET_AT_START and (_get(running, key) is None) != (_get(merged, key) is None):
            refused.append(RefusedKey(key, SET_AT_START[key]))
        else:
            applied.append(key)
    for r in refused:
        _set(merged, r.key, _get(running, r.key))
    try:
        effective = Config.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(
            f"{source}: the keys that apply live ({', '.join(applied)}) do not fit the running "
            f"values of those that need a restart ({', '.join(r.key for r in refused)}): "
            f"{e.errors()[0]['msg']}; restart the agent to apply them all") from None
    result = ReloadResult(
        source=source, at=time.time(), applied=tuple(applied), refused=tuple(refused),
        engine_restart=any(POLICY[k][0] is Apply.ENGINE for k in applied))
    return effective, result


def policy_markdown() -> str:
    """The table docs/operations.md shows (tests/test_reload.py keeps the two equal)."""
    words = {Apply.LIVE: "applied", Apply.ENGINE: "applied; the engine is replaced",
             Apply.RESTART: "refused: needs a restart"}
    rows = ["| key | on reload | when, or why not |", "| --- | --- | --- |"]
    rows += [f"| `{key}` | {words[how]} | {why} |" for key, (how, why) in POLICY.items()]
    return "\n".join(rows) + "\n"
