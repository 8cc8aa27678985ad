"""The `pitstop snapshot` and `pitstop drift` commands: the store's snapshots, local and remote,
and how a snapshot's identity compares with this host's."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from agent.errors import EXIT_FAIL, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from agent.config import Config
    from agent.identity import Identity
    from agent.store import SnapshotStore


def cmd_snapshot(args: argparse.Namespace) -> int:
    import json

    from agent.config import load_config
    from agent.store import SnapshotStore, views

    cfg = load_config(args.config)
    if args.action == "create":
        import asyncio

        from agent.control import call
        from agent.status_text import format_created

        done = asyncio.run(call(cfg.paths.run / "control.sock", "snapshot"))
        out, err = (json.dumps(done, indent=1), "") if args.json else format_created(done)
        print(out)
        if err:
            print(err, file=sys.stderr)
        return EXIT_OK
    store = SnapshotStore(cfg.paths.snapshots)
    if args.action in ("push", "pull"):
        return _snapshot_transfer(args, cfg, store)
    if args.action == "list":
        # Every backend's snapshots in one list; the quarantine (every backend's) in the same
        # shape.
        if args.quarantined:
            aside = store.quarantined()
            out = json.dumps([views.quarantined_json(q) for q in aside], indent=1) \
                if args.json else views.quarantined_text(aside)
        else:
            entries = store.entries()
            out = json.dumps([views.entry_json(e) for e in entries], indent=1) if args.json \
                else views.entries_text(entries)
    elif args.action == "inspect":
        m = store.load(args.id)
        out = m.model_dump_json(indent=1) if args.json else views.manifest_text(m)
    elif args.action == "memory":
        out = _snapshot_memory(store, args.id, args.json)
    elif args.action == "verify":
        verdicts = [store.verify(i) for i in (args.ids or store.ids())]
        out = json.dumps([views.verdict_json(v) for v in verdicts], indent=1) if args.json \
            else "\n".join(views.verdict_text(v) for v in verdicts) or "no snapshots"
        print(out)
        return EXIT_OK if all(v.ok for v in verdicts) else EXIT_FAIL
    else:
        for i in args.ids:
            store.delete(i)
        out = json.dumps({"deleted": args.ids}) if args.json else f"deleted {' '.join(args.ids)}"
    print(out)
    return EXIT_OK


def _snapshot_memory(store: SnapshotStore, sid: str, as_json: bool) -> str:
    """`pitstop snapshot memory ID`: the image's page bytes by process and mapping."""
    import dataclasses
    import json

    from agent.checkpoint.criu_image import ImageDamagedError, ImageFormatError
    from agent.checkpoint.image_memory import image_memory, images_in, memory_text
    from agent.errors import SnapshotError

    store.load(sid)  # a clear error for an unknown or broken one
    where = images_in(store.path(sid))
    if where is None:
        raise SnapshotError(f"snapshot {sid} holds no CRIU image (no pagemap-*.img under "
                            f"{store.path(sid)})")
    try:
        rows = image_memory(where)
    except ImageDamagedError as e:
        raise SnapshotError(f"snapshot {sid}: its CRIU image is damaged ({e}); it cannot be "
                            f"restored either: `pitstop snapshot delete {sid}`") from e
    except ImageFormatError as e:
        raise SnapshotError(f"snapshot {sid}: its CRIU image is not laid out as this Pitstop "
                            f"reads ({e}); the image may still be sound, only not "
                            "measurable here") from e
    return json.dumps([dataclasses.asdict(r) for r in rows], indent=1) if as_json \
        else memory_text(rows)


def _snapshot_transfer(args: argparse.Namespace, cfg: Config, store: SnapshotStore) -> int:
    """`pitstop snapshot push [ID]` and `pitstop snapshot pull`: to and from the S3 store."""
    import json

    from agent.config import S3Url
    from agent.store import remote
    from agent.store.s3 import Bucket

    where = args.url or cfg.snapshots.remote
    if where is None:
        print(f"pitstop: no store to {args.action} {'to' if args.action == 'push' else 'from'}:"
              " set snapshots.remote in the configuration or pass --url s3://BUCKET/PREFIX",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        url = S3Url.parse(where)
    except ValueError as e:
        print(f"pitstop: --url: {e}", file=sys.stderr)
        return EXIT_USAGE
    bucket = Bucket(url)
    if args.action == "push":
        sid = args.id or next((e.id for e in store.entries() if e.manifest), None)
        if sid is None:
            print(f"pitstop: no snapshot in {cfg.paths.snapshots} to push", file=sys.stderr)
            return EXIT_USAGE
        done = remote.push(store, sid, bucket)
    else:
        kinds = (args.kind,) if args.kind else remote.PORTABLE_KINDS
        done = remote.pull(store, bucket, _host_identity(cfg), kinds=kinds,
                           timeout_s=cfg.snapshots.pull_timeout_s)
    if args.json:
        print(json.dumps({**vars(done), "mb_per_s": round(done.mb_per_s, 1)}, indent=1))
    else:
        print(f"{done.direction} {done.snapshot} ({done.kind}): {done.detail}; "
              f"{done.bytes / 1e6:.1f} MB in {done.seconds:.2f}s ({done.mb_per_s:.0f} MB/s)")
    return EXIT_OK


def _host_identity(cfg: Config) -> Identity:
    """This host's identity as the agent reads it (CRIU's version included)."""
    from agent.checkpoint.criu_locate import locate
    from agent.drift_watch import build_reader
    from agent.engines import build_adapter
    from agent.errors import SnapshotError

    try:
        criu = locate(cfg.snapshots.criu).version
    except SnapshotError:
        criu = None  # as the agent records it when it has no CRIU
    return build_reader(cfg, build_adapter(cfg), criu)()


def cmd_drift(args: argparse.Namespace) -> int:
    import json

    from agent.config import load_config
    from agent.drift import classify
    from agent.errors import SnapshotError
    from agent.identity import REMAPPED_FIELDS
    from agent.store import SnapshotStore

    cfg = load_config(args.config)
    store = SnapshotStore(cfg.paths.snapshots)
    try:
        if args.snapshot:
            manifest = store.load(args.snapshot)
        else:
            manifest = next((e.manifest for e in store.entries() if e.manifest), None)
    except SnapshotError as e:
        print(f"pitstop: {e}", file=sys.stderr)
        return EXIT_USAGE
    if manifest is None:
        print(f"pitstop: no readable snapshot in {cfg.paths.snapshots} to compare with; "
              "`pitstop snapshot list` shows them", file=sys.stderr)
        return EXIT_USAGE
    now = _host_identity(cfg)
    # vLLM's own snapshots are restored by `vllm snapshot restore`, which remaps nothing.
    remapped = frozenset() if manifest.kind == "vllm" else REMAPPED_FIELDS
    diffs = classify(manifest.identity, now, remapped)
    refused = [d for d in diffs if not d.remapped]
    if args.json:
        print(json.dumps({"snapshot": manifest.id, "drift": bool(refused), "differences": [
            {"field": d.field, "old": d.old, "new": d.new, "remapped": d.remapped}
            for d in diffs]}, indent=1))
    else:
        for d in diffs:
            print(str(d) + (" (remapped at restore)" if d.remapped else ""))
        if not refused:
            print(f"snapshot {manifest.id} matches this host")
    return EXIT_FAIL if refused else EXIT_OK
