"""`python -m agent.engines.refengine --model DIR --uds PATH`: run the reference engine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.engines.refengine.keptkv import HeldKV
    from agent.tenant.weights import HeldWeights

log = logging.getLogger("refengine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agent.engines.refengine", description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="Hugging Face Llama model directory")
    p.add_argument("--uds", type=Path, help="listen on this Unix socket")
    p.add_argument("--host", help="also listen on TCP (a checkpointed engine should not)")
    p.add_argument("--port", type=int)
    p.add_argument("--served-model-name", help="the name clients use (default: DIR's name)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--kv-slots", type=int, default=8, help="requests served at once")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per request, prompt included (default: min(config, 2048))")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: on a small, busy machine OpenMP "
                        "barriers make a tiny model 10x slower with more)")
    p.add_argument("--prefill-chunk", type=int, default=1,
                   help="prompt tokens per forward call; above 1, a resumed greedy request "
                        "may differ in the last bits from an uninterrupted one")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, replay one-token steps from CUDA graphs (default on)")
    p.add_argument("--prepare-stack", type=int, metavar="BYTES",
                   help="on a GPU, set the per-thread stack to BYTES at a snapshot's "
                        "prepare (CUDA's default: 1024), so local memory the driver keeps "
                        "for a larger one stays out of the image (grown again on use)")
    p.add_argument("--gpu-memory-utilization", type=float, metavar="SHARE",
                   help="on a GPU, the share of its memory (0 to 1) torch may allocate in "
                        "this engine: the KV pool, activations and graphs (weights held by "
                        "the holder are the holder's); for engines sharing a GPU, as vLLM's "
                        "flag of the same name (default: no cap)")
    p.add_argument("--holder", type=Path, metavar="SOCK",
                   help="keep the weights in the holder at SOCK: attach them when held "
                        "(a warm start), else load them from disk into it and commit")
    p.add_argument("--keep-kv", action=argparse.BooleanOptionalAction, default=None,
                   help="with --holder, keep the KV pool and its ledger in the holder, so a "
                        "request resumed after a crash continues without prefilling again "
                        "(default on with --holder)")
    p.add_argument("--kv-owner", default="", metavar="NAME",
                   help="with a kept KV pool, whose it is: engines of other owners on the "
                        "same holder keep pools of their own (the agent gives its engine's "
                        "socket); default: the pool of any engine of these weights and layout")
    p.add_argument("--kv-lease-s", type=float, default=None, metavar="S",
                   help="seconds the holder keeps a KV pool no engine claims (default 600)")
    p.add_argument("--weights-digest", metavar="DIGEST",
                   help="the weights' digest, as the agent computed it; without it the "
                        "engine hashes every weight file (reading them all)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s refengine[%(process)d] %(message)s")
    if args.uds is None and args.port is None:
        print("refengine: give --uds PATH and/or --host/--port", file=sys.stderr)
        return 2
    if args.keep_kv and args.holder is None:
        print("refengine: --keep-kv keeps the KV pool in the holder: give --holder SOCK too",
              file=sys.stderr)
        return 2
    if args.kv_lease_s is not None and not 0 < args.kv_lease_s <= 7 * 86400:
        print(f"refengine: --kv-lease-s {args.kv_lease_s:g} is out of range; give seconds "
              "above 0, at most 604800 (a week)", file=sys.stderr)
        return 2
    if args.prepare_stack is not None and not 0 < args.prepare_stack <= 1 << 20:
        print("refengine: --prepare-stack takes bytes, above 0 and at most 1048576",
              file=sys.stderr)
        return 2
    share = args.gpu_memory_utilization
    if share is not None and not 0 < share <= 1:
        print(f"refengine: --gpu-memory-utilization {share:g} is out of range; give a share of "
              "the GPU's memory above 0 and at most 1", file=sys.stderr)
        return 2
    if min(args.kv_slots, args.prefill_chunk, args.threads) < 1:
        print("refengine: --kv-slots, --prefill-chunk and --threads must be at least 1",
              file=sys.stderr)
        return 2
    from agent.errors import HolderError, MissingExtraError, ModelError
    from agent.extras import Extra, require

    try:
        require(Extra.REFERENCE, "the reference engine")
        _precheck(args)  # before importing torch: a bad start fails in milliseconds
        return asyncio.run(_serve(args))
    except (ModelError, HolderError, MissingExtraError) as e:
        print(f"refengine: {e}", file=sys.stderr)
        return 2


def _precheck(args: argparse.Namespace) -> None:
    from agent.errors import ModelError

    path = args.model / "config.json"
    try:
        positions = int(json.loads(path.read_text()).get("max_position_embeddings", 2048))
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"{path}: cannot read the model config ({e}); make a model with "
                         "`pitstop make-model DIR` or point --model at a Llama directory") from e
    if args.max_model_len and args.max_model_len > positions:
        raise ModelError(f"--max-model-len {args.max_model_len} exceeds the model's "
                         f"max_position_embeddings ({positions}) in {path}; use at most that")


async def _serve(args: argparse.Namespace) -> int:
    import torch
    from aiohttp import web

    from agent.engines.refengine.kvpool import KVPool
    from agent.engines.refengine.model import Llama
    from agent.engines.refengine.scheduler import Scheduler
    from agent.engines.refengine.server import EngineApp
    from agent.engines.refengine.tokenizer import Tokenizer

    # Fixed for the life of the process: results must not depend on how busy the host is.
    torch.set_num_threads(args.threads)
    device = _device(args)
    held = _held_weights(args, device) if args.holder is not None else None
    model = Llama.load(args.model, device, None if args.dtype == "auto" else args.dtype,
                       held=held.tensors if held is not None else None,
                       cuda_graphs=args.cuda_graphs)
    tokenizer = Tokenizer(args.model)
    cfg = model.config
    max_len = min(args.max_model_len or 2048, cfg.max_position_embeddings)
    pool = KVPool(cfg, args.kv_slots, max_len, device, model.dtype,
                  held=_held_kv(args, cfg, max_len, device, model.dtype, held))
    eos = set(cfg.eos_token_ids)
    if not eos and tokenizer.token_id(tokenizer.eos_token) is not None:
        eos = {tokenizer.token_id(tokenizer.eos_token)}  # type: ignore[arg-type]

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    failure: list[BaseException] = []

    def on_fatal(e: BaseException) -> None:
        failure.append(e)
        loop.call_soon_threadsafe(done.set)

    sched = Scheduler(model, pool, eos, args.prefill_chunk, on_fatal)
    sched.start()
    name = args.served_model_name or args.model.name
    app = EngineApp(model, tokenizer, sched, name, str(args.model), held=held,
                    prepare_stack=args.prepare_stack)
    runner = web.AppRunner(app.build(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    where = []
    if args.uds is not None:
        await web.UnixSite(runner, str(args.uds)).start()
        where.append(str(args.uds))
    if args.port is not None:
        await web.TCPSite(runner, args.host or "127.0.0.1", args.port).start()
        where.append(f"{args.host or '127.0.0.1'}:{args.port}")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    log.info("ready: model %s (%s, %s, %.1f MB of weights) on %s, %d KV slots x %d tokens "
             "(%.1f MB), serving %s", name, device, str(model.dtype).removeprefix("torch."),
             model.weight_bytes / 1e6, ", ".join(where), pool.slots, max_len,
             pool.nbytes / 1e6, args.model)
    await done.wait()
    log.info("stopping")
    # Stop generating first: handlers still streaming get an error and end, so the
    # runner's cleanup does not wait for them.
    await asyncio.to_thread(sched.stop)
    await runner.cleanup()
    if args.uds is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.uds)
    return 1 if failure else 0


def _device(args: argparse.Namespace) -> Any:
    """The torch device to serve on, with its share of GPU memory capped when one is given."""
    import torch

    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and args.gpu_memory_utilization is not None:
        # A cap on torch's caching allocator: beyond it an allocation fails as out of memory
        # instead of taking what an engine beside this one on the GPU counts on.
        # It wants an index: "cuda" alone is refused (ValueError), the current device meant.
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(args.gpu_memory_utilization, index)
    return device


def _held_kv(args: argparse.Namespace, cfg: Any, max_len: int, device: Any, dtype: Any,
             held: HeldWeights | None) -> HeldKV | None:
    """The KV pool's place in the holder, or None (a private pool)."""
    if args.holder is None or args.keep_kv is False:
        return None
    from agent.engines.refengine.keptkv import DEFAULT_LEASE_S, HeldKV, layout_digest
    from agent.engines.refengine.kvpool import KVPool
    from agent.holder.kvledger import LedgerShape

    digest = held.digest if held is not None else args.weights_digest
    if digest is None:
        log.warning("kept KV off: the weights are not in the holder and have no digest to "
                    "name their KV by")
        return None
    shape, nbytes = KVPool.layout(cfg, args.kv_slots, max_len, dtype)
    ledger = LedgerShape(entries=args.kv_slots, max_tokens=max_len, max_blocks=1)
    return HeldKV(args.holder, layout_digest(digest, shape, dtype, ledger, args.kv_owner), nbytes,
                  ledger, device, args.kv_lease_s or DEFAULT_LEASE_S)


def _held_weights(args: argparse.Namespace, device: object) -> HeldWeights | None:
    """The weights in the holder; None (load privately) when another engine is loading
    the same weights into it right now. A holder that is down is an error: the agent
    asked for a warm start and falls to a cold one."""
    from agent.engines.refengine.model import weight_files
    from agent.errors import HolderRefusedError
    from agent.holder.protocol import ErrorCode
    from agent.tenant.weights import HeldWeights
    from agent.weights import WeightsDigester

    files = weight_files(args.model)
    digest = args.weights_digest
    if digest is None:
        # The agent's own digest, computed the agent's way (uncached: every file is read).
        log.warning("no --weights-digest: hashing %s to name the held regions", args.model)
        digest = WeightsDigester(None).digest(args.model).digest
    try:
        return HeldWeights.open(args.holder, files, digest, device)
    except HolderRefusedError as e:
        if e.code is not ErrorCode.BUSY:
            raise
        log.warning("%s; loading the weights privately this time", e)
        return None


if __name__ == "__main__":
    raise SystemExit(main())
