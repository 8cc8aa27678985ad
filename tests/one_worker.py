"""A stand-in engine adapter for tests of the restore rungs: an engine of one worker."""

from __future__ import annotations

from agent.refusal import Refusal


class OneWorker:
    """What a restore rung asks of an engine adapter before it restores (agent/engines/
    base.py): one worker, so its images are taken and restored and one set is held.

    Example::

        FullRestore(snapshotter=snap, unavailable="", adapter=OneWorker(), ...)
    """

    def held_keys(self, digest: str) -> list[str]:
        return [digest]

    def warm_refusal(self, regions: list[str]) -> Refusal | None:
        return None

    def image_refusal(self) -> Refusal | None:
        return None

    def one_worker_refusal(self, rung: str) -> Refusal | None:
        return None

    def holder_refusal(self) -> Refusal | None:
        return None
