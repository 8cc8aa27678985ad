"""Why something was refused (a snapshot, a rung, a resume): a typed code plus detail."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RefusalCode(StrEnum):
    """Why a snapshot, a rung of the ladder or a stream resume was refused.

    A value is what metric labels carry (`pitstop_snapshots_rejected_total{reason}`,
    `pitstop_snapshot_stale{reason}`); docs/metrics.md lists them. The words for people are
    in `Refusal.detail`, never parsed back into a code.
    """

    # --- a snapshot the store or vLLM passed over -------------------------------------
    # Its identity differs from this host's (driver, weights, engine arguments, ...).
    STALE = "stale"
    # Its files no longer verify against its manifest: quarantined, never used again.
    CORRUPT = "corrupt"
    # Its directory or files are not private to the agent's user (mode, owner, symlink).
    PERMISSIONS = "permissions"
    # Its manifest is missing, truncated or invalid.
    UNREADABLE = "unreadable"
    # Something with a snapshot's name that is not a snapshot directory.
    NOT_A_SNAPSHOT = "not_a_snapshot"
    # Usable, but a newer one was chosen.
    SUPERSEDED = "superseded"
    # A snapshot of the other kind (hybrid or full) than the rung restores.
    WRONG_KIND = "wrong_kind"
    # Its restore or the engine's resume after it failed: quarantined.
    RESTORE_FAILED = "restore_failed"
    # A push to or pull from the remote store (snapshots.remote) stopped part way: the
    # network, the store, its timeout or the local disk; nothing was published.
    TRANSFER_FAILED = "transfer_failed"
    # --- how `vllm snapshot` failed (agent/engines/vllm/snapshot.py `map_failure`) ----
    FAILED = "failed"
    INVALID_ARGS = "invalid_args"
    UNSUPPORTED = "unsupported"
    NOT_FOUND = "not_found"
    # The restored engine answered vLLM's canary differently from when it was taken.
    CANARY = "canary"
    PID_TAKEN = "pid_taken"
    NO_CUDA = "no_cuda"
    NO_CRIU = "no_criu"
    NO_CUDA_PLUGIN = "no_cuda_plugin"
    # --- a rung that cannot be tried now ----------------------------------------------
    # No snapshot backend on this host (`pitstop doctor` says why).
    SNAPSHOTS_UNAVAILABLE = "snapshots_unavailable"
    NO_SNAPSHOT = "no_snapshot"
    # Snapshots exist but each was refused (their own codes say why).
    NO_USABLE_SNAPSHOT = "no_usable_snapshot"
    # Turned off in the configuration (holder.enabled, vllm.preload.enabled), or not set up
    # (vllm.snapshot.model and revision unset).
    DISABLED = "disabled"
    NO_WEIGHTS_DIGEST = "no_weights_digest"
    HOLDER_DOWN = "holder_down"
    WEIGHTS_NOT_HELD = "weights_not_held"
    NO_HELD_REGIONS = "no_held_regions"
    # The engine reads a parameter or buffer outside held memory (vLLM made it after the
    # load): an image or a warm start would serve it by accident, so the holder rungs are
    # skipped.
    WEIGHTS_OUTSIDE_HOLDER = "weights_outside_holder"
    # The held weights are what a quantization method that cannot start from its own
    # output made (vLLM: most online quantizations, compressed-tensors, AWQ, GPTQ): hybrid and
    # refill map them as they are, a warm start would transform them a second time.
    WEIGHTS_NOT_RESTARTABLE = "weights_not_restartable"
    # The holder's regions are not those the hybrid snapshot was taken with.
    HELD_STALE = "held_stale"
    # The last start given the holder's flags failed (a model whose load over the holder
    # does not fit the GPU, say): starts load from disk and the holder rungs are skipped
    # until the weights change or the configuration is reloaded.
    HELD_START_FAILED = "held_start_failed"
    # The standby rung (agent/supervisor/paths/standby.py): none is armed (snapshots.standby
    # off, no hybrid snapshot yet, still restoring, or it died), it was restored from
    # another snapshot than the newest usable one, or continuing it or its resume failed.
    STANDBY_NOT_ARMED = "standby_not_armed"
    STANDBY_STALE = "standby_stale"
    STANDBY_FAILED = "standby_failed"
    # The refill rung (agent/supervisor/paths/refill.py): the holder holds the weights
    # already (the hybrid rung's case), no refill plan for them, the files changed since the
    # plan was made, or the plan's regions are not the image's.
    WEIGHTS_HELD = "weights_held"
    NO_REFILL_PLAN = "no_refill_plan"
    WEIGHTS_CHANGED = "weights_changed"
    REFILL_LAYOUT = "refill_layout"
    # Held regions in the engine's own layout (vLLM's parameters) and no recipe that
    # rebuilds them from the model files (agent/holder/recipe.py): none could be made, one
    # did not rebuild the held bytes, or a pulled hybrid image carries none.
    NO_REFILL_RECIPE = "no_refill_recipe"
    NO_VLLM = "no_vllm"
    # Pitstop's vLLM plugin (agent/engines/vllm/adapter.py `plugin_refusal`): not installed in
    # vLLM's interpreter, another version than the agent's, a vLLM version it refuses (not
    # readable, or an untested series under vllm.plugin.untested: refuse), or a vLLM that
    # lacks an internal the plugin uses; vLLM's hybrid and warm rungs are then skipped.
    PLUGIN_NOT_INSTALLED = "plugin_not_installed"
    PLUGIN_VERSION_MISMATCH = "plugin_version_mismatch"
    VLLM_VERSION_UNSUPPORTED = "vllm_version_unsupported"
    VLLM_INTERNALS_MISSING = "vllm_internals_missing"
    NO_GPU = "no_gpu"
    PRELOAD_DOWN = "preload_down"
    # vLLM runs several workers (agent/engines/vllm/parallel.py). Tensor parallel: on
    # CUDA no image rung and no snapshot (a multi-GPU checkpoint needs driver 590+), and no
    # held weights (each rank's set belongs in its own GPU's holder, not wired yet); on CPU
    # only refill and the standby refuse it (they serve one worker). Pipeline or data
    # parallel: nothing held, no image; the cold start only.
    TENSOR_PARALLEL = "tensor_parallel"
    PARALLEL_UNSUPPORTED = "parallel_unsupported"
    # Not tried: it would reuse memory that a GPU fault made suspect.
    GPU_FAULT = "gpu_fault"
    # --- a rung that was tried and failed ---------------------------------------------
    RESUME_FAILED = "resume_failed"
    # The holder could not load the weights from their files (nothing was committed).
    REFILL_FAILED = "refill_failed"
    RELAY_FAILED = "relay_failed"
    # The engine could not be started, died or stayed unhealthy.
    ENGINE_FAILED = "engine_failed"
    # The engine answered, but not the configured model or the recorded canary answer.
    VERIFY_FAILED = "verify_failed"
    # --- a cut stream the front cannot continue (agent/front/resume.py) ---------------
    # The request's options cannot be carried over (n > 1, logprobs, tools, ...).
    REQUEST_NOT_RESUMABLE = "request_not_resumable"
    ENGINE_ERROR = "engine_error"
    NO_PROMPT_IDS = "no_prompt_ids"


@dataclass(frozen=True)
class Refusal:
    """A refusal: `code` for metrics and programs, `detail` for people (logs, status).

    Example::

        r = Refusal(RefusalCode.STALE, "driver_version: '550.1' -> '560.2'")
        r.code.value, str(r)  # ('stale', "driver_version: '550.1' -> '560.2'")
    """

    code: RefusalCode
    detail: str

    def __str__(self) -> str:
        return self.detail

    def to_json(self) -> dict[str, str]:
        return {"code": self.code.value, "detail": self.detail}
