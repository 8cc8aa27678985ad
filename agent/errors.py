"""The exception classes: one per failure area, each message says what to do."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

# A leaf module: this one stays low, importing nothing else of agent/.
from agent.refusal import Refusal, RefusalCode

if TYPE_CHECKING:
    # Only the type: errors is imported everywhere, the protocol brings pydantic.
    from agent.holder.protocol import ErrorCode


class BlockingConnection(Protocol):
    """One connection that stops a dump: agent.checkpoint.connections.OutsideConnection is the
    one kind there is. Named by shape, since this low module imports no checkpoint code."""

    @property
    def reason(self) -> StrEnum: ...


class PitstopError(Exception):
    """Base of every error Pitstop reports to a user."""


class ConfigError(PitstopError):
    """The configuration file is missing, malformed or invalid."""


class MissingExtraError(ConfigError):
    """What the configuration or command asks for needs a pip extra that is not installed.

    A ConfigError: starting again cannot fix it, installing the extra named does.
    """


class AgentRunningError(PitstopError):
    """Another agent already holds this state directory: this one refuses to start."""


class ModelError(PitstopError):
    """A model directory cannot be made or loaded."""


class EngineError(PitstopError):
    """The engine could not be started, reached or stopped."""


class VerifyError(EngineError):
    """The engine answered, but not with the recorded canary answer."""


class StartPathError(PitstopError):
    """One rung of the recovery ladder failed; the supervisor falls to the next.

    `refusal` says why, typed: `StartPathError(Refusal(RefusalCode.RESTORE_FAILED, "..."))`.
    """

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.detail)
        self.refusal = refusal


class CommandError(PitstopError):
    """An external command failed or timed out."""


class SnapshotError(PitstopError):
    """A snapshot could not be taken, verified or restored."""


class SnapshotUnusableError(SnapshotError):
    """A published snapshot cannot be read as one; `refusal` says why (permissions, ...)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.detail)
        self.refusal = refusal


class RemoteError(SnapshotError):
    """A push to or pull from the remote snapshot store was refused or failed; `refusal`
    says why (stale, corrupt, no_snapshot, transfer_failed). Nothing half-made was published."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.detail)
        self.refusal = refusal


class RestoreBlockedError(SnapshotError):
    """A restore could not run for a reason of this host, not of the image (a PID it must get
    back is taken): the snapshot is not quarantined and stays a candidate."""


class OpenConnectionsError(SnapshotError):
    """A snapshot was refused before CRIU ran: connections from outside the tree are open.

    `connections` names each one (its reason code, inode, both addresses, the holder).
    """

    def __init__(self, connections: tuple[BlockingConnection, ...]) -> None:
        self.connections = connections
        n = len(connections)
        super().__init__(
            f"{n} connection{'s' if n != 1 else ''} from outside the engine's process tree "
            f"{'are' if n != 1 else 'is'} open, which a dump cannot take: "
            + "; ".join(map(str, connections))
            + f". Close {'them' if n != 1 else 'it'} (a client that keeps a connection to the "
            "engine open) and snapshot again")

    @property
    def reasons(self) -> tuple[StrEnum, ...]:
        return tuple(dict.fromkeys(c.reason for c in self.connections))


class StatusError(PitstopError):
    """The agent's status could not be read."""


class HolderError(PitstopError):
    """The memory holder refused a request, or cannot be reached."""


class HolderUnavailableError(HolderError):
    """No holder answers on the socket: it is not running, or the socket is not ours."""


class HolderRefusedError(HolderError):
    """The holder answered a request with an error; `code` says which (not_found, busy...);
    None when the answer itself broke the protocol."""

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class HolderInvariantError(HolderError):
    """The holder's own bookkeeping broke; the holder stops rather than serve bad memory."""


class MappingError(HolderError):
    """Held memory could not be mapped, detached or re-attached in the tenant."""


class IdentityError(PitstopError):
    """A fact of the host's identity (GPU, engine packages, ...) could not be read."""


class SourceUnavailable(IdentityError):
    """An identity source is absent on this host (no NVIDIA driver, say): a valid None."""


class WeightsError(PitstopError):
    """The model's weight and config files could not be listed or hashed."""


class FrontError(PitstopError):
    """The front proxy could not bind its port or serve a request."""


class FrontRejected(FrontError):
    """The front turned a request away (queue full, deadline, draining); it says when to retry.

    Not a fault: the client gets 503 with Retry-After, and the reason is counted.
    """

    def __init__(self, reason: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class UnitsError(PitstopError):
    """The systemd units could not be rendered, installed or enabled."""


class VllmSnapshotError(SnapshotError):
    """`vllm snapshot create|inspect|restore` failed; `code` says how (stale, canary...)."""

    def __init__(self, message: str, code: RefusalCode | str = RefusalCode.FAILED) -> None:
        super().__init__(message)
        # A code outside RefusalCode is a bug here, not a new label: ValueError at once.
        self.code = RefusalCode(code)


class VllmPreloadError(EngineError):
    """vLLM's weight-cache daemon (`vllm preload`) could not be started or is not healthy."""


# The `pitstop` command's exit statuses (the agent's unit prevents a restart on EXIT_USAGE:
# a configuration that is wrong stays wrong).
EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
