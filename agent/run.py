"""`pitstop run`: take the state directory, then run the agent that agent/wiring.py builds."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
from pathlib import Path

from agent.config import load_config
from agent.fsutil import private_dir
from agent.supervisor.ownership import EngineLedger, StateLock, Tether
from agent.systemd import Notifier
from agent.wiring import Agent

log = logging.getLogger("pitstop")


def setup_logging(verbose: bool = False) -> None:
    # Under systemd the journal stamps each line itself.
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not os.environ.get("JOURNAL_STREAM"):
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=fmt,
                        stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def run_agent(config_path: Path | None, verbose: bool = False, engine: str = "") -> int:
    """Run the agent of `config_path`; `engine` names it among the node's engines (the
    template unit's instance): every metric it exports carries that name."""
    setup_logging(verbose)
    # The watchdog's SIGABRT then prints where a stuck agent was stuck, to the journal.
    faulthandler.enable()
    config = load_config(config_path)
    private_dir(config.paths.state_dir)
    # Before anything touches the state directory (the snapshot store cleans its drafts):
    # a second agent here would kill the first one's engine and corrupt its snapshots.
    with StateLock.take(config.paths.state_dir):
        # Outside systemd nothing else cleans up after an agent that was SIGKILLed.
        EngineLedger(config.paths.state_dir).kill_leftovers()
        try:
            tether = Tether.start()
            log.info("tether PID %d kills what the engine leaves should this agent die",
                     tether.pid)
        except OSError as e:
            log.warning("cannot start the tether (%s): should this agent die, what its engine "
                        "leaves is killed only when the next agent starts", e)
            tether = None
        agent = Agent.start(config, config_path, Notifier(), tether=tether, engine=engine)
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(agent.run())
    return 0
