"""The agent's status and a reload's result in words, for `pitstop status` and `pitstop reload`."""

from __future__ import annotations

import time


def format_reload(result: dict) -> str:
    """A reload report (agent/reload.py's ReloadResult as JSON) for people."""
    if result["error"]:
        return f"reload refused, the running configuration is kept: {result['error']}"
    if not result["applied"] and not result["refused"]:
        return f"reloaded {result['source']}: nothing changed"
    lines = [f"reloaded {result['source']}"]
    if result["applied"]:
        lines.append("applied: " + ", ".join(result["applied"])
                     + (" (the engine is being replaced)" if result["engine_restart"] else ""))
    for r in result["refused"]:
        lines.append(f"refused, needs a restart of the agent: {r['key']} ({r['why']})")
    return "\n".join(lines)


def format_created(done: dict) -> tuple[str, str]:
    """`pitstop snapshot create`'s answer for people: what was published, and, for standard
    error, that the engine it was taken of cannot serve (the agent replaces it)."""
    out = (f"snapshot {done['id']} published: {done['bytes'] / 1e6:.1f} MB in "
           f"{done['duration_s']:.2f}s")
    if "engine_failed" not in done:
        return out, ""
    return out, (f"but {done['engine_failed']}; the agent replaces the engine "
                 "(`pitstop status` shows the recovery)")


def format_status(data: dict) -> str:
    """`pitstop status` for people: the status file's JSON (agent/supervisor/status.py), a
    line a part.

    Example::

        print(format_status(StatusFile(run_dir / "status.json").read()))
    """
    lines = [*_engine_lines(data), *_recovery_lines(data.get("last_recovery"))]
    if data.get("gpu"):
        lines.append(f"gpu:      {data['gpu']}")
    lines.append(f"restarts: {data.get('restarts', 0)}")
    lines += _store_lines(data)
    lines += _transfer_lines(data)
    reload = data.get("last_reload")
    if reload:
        lines.append("reload:   " + format_reload(reload).replace("\n", "\n  "))
    if data.get("front"):
        lines.append("front:    " + _served(data["front"], "/v1", data.get("front_access"),
                                            "API key"))
    if data.get("metrics"):
        lines.append("metrics:  " + _served(data["metrics"], "/metrics",
                                            data.get("metrics_access"), "basic-auth user"))
    return "\n".join(lines)


def _engine_lines(data: dict) -> list[str]:
    lines = [f"state:    {data['state']}" + (f" ({data['reason']})" if data.get("reason") else "")]
    version = " ".join(v for v in (data.get("engine_distribution"), data.get("engine_version"))
                       if v)
    lines.append(f"engine:   {data.get('engine_kind', '?')}" + (f" ({version})" if version else "")
                 + f", pid {data.get('engine_pid') or '-'}")
    since = data.get("engine_ready_since")
    if since and data.get("engine_pid"):
        lines.append(f"uptime:   {time.time() - since:.0f}s")
    return lines


def _recovery_lines(rec: dict | None) -> list[str]:
    if not rec:
        return []
    lines = [f"last recovery: {rec['path']} ({rec['cause']}) {rec['result']} in "
             f"{rec['duration_s']:.2f}s"]
    for f in rec.get("fallthroughs", []):
        r = f["refusal"]
        lines.append(f"  fell through: {f['path']} {f['kind'].replace('_', ' ')}: "
                     f"{r['detail']} ({r['code']})")
    if rec.get("gpu_peak_bytes") is not None:
        lines.append(f"  peak GPU memory in use: {rec['gpu_peak_bytes'] / 2**30:.2f} GiB")
    return lines


def _store_lines(data: dict) -> list[str]:
    """The last snapshot error, the newest snapshot and the holder."""
    lines = []
    if data.get("snapshot_error"):
        lines.append(f"snapshot: {data['snapshot_error']}")
    newest = data.get("newest_snapshot")
    if newest:
        lines.append(f"snapshot: {newest['id']} ({newest['kind']}, "
                     f"{newest['bytes_on_disk'] / 1e6:.1f} MB)")
    holder = data.get("holder")
    if holder:
        lines.append("holder:   " + (f"up, {holder['bytes_held'] / 2**30:.2f} GiB held"
                                     if holder["up"] else "not answering")
                     + ("; bypassed: the last start over it failed, starts load from disk "
                        "until a reload" if holder.get("bypassed") else ""))
    return lines


def _transfer_lines(data: dict) -> list[str]:
    """The last pull from and push to the remote store, one line each."""
    out = []
    for key in ("last_pull", "last_push"):
        t = data.get(key)
        if not t:
            continue
        what = f"{t['snapshot']} ({t['kind']}): " if t["snapshot"] else ""
        moved = f", {t['bytes'] / 1e6:.1f} MB in {t['seconds']:.2f}s" if t["bytes"] else ""
        out.append(f"{t['direction']}:     {t['result']}: {what}{t['detail']}{moved}")
    return out


def _served(address: str, path: str, access: dict | None, credential: str) -> str:
    """A port's URL and how it is protected (AgentStatus's PortAccess as JSON)."""
    access = access or {}
    n = access.get("credentials") or 0
    guards = [f"{n} {credential}{'s' if n > 1 else ''}"] if n else []
    if access.get("client_certificates"):
        guards.append("client certificates")
    scheme = "https" if access.get("tls") else "http"
    return f"{scheme}://{address}{path} ({', '.join(guards) or 'no authentication'})"
