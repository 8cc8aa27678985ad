"""The exception classes: one per failure area, each message says what to do."""


class PitstopError(Exception):
    """Base of every error Pitstop reports to a user."""


class ConfigError(PitstopError):
    """The configuration file is missing, malformed or invalid."""


class ModelError(PitstopError):
    """A model directory cannot be made or loaded."""


class EngineError(PitstopError):
    """The engine could not be started, reached or stopped."""


class VerifyError(EngineError):
    """The engine answered, but not with the recorded canary answer."""


class StartPathError(PitstopError):
    """One rung of the recovery ladder failed; the supervisor falls to the next."""


class CommandError(PitstopError):
    """An external command failed or timed out."""


class SnapshotError(PitstopError):
    """A snapshot could not be taken, verified or restored."""


class StatusError(PitstopError):
    """The agent's status could not be read."""


class UnitsError(PitstopError):
    """The systemd units could not be rendered, installed or enabled."""
