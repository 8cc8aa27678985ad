"""Print, as JSON, whether this host's NVIDIA driver offers the CUDA checkpoint API."""

import ctypes
import json

# The driver API calls Pitstop's CUDA checkpoint backend makes (through cuda-bindings).
SYMBOLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


def main() -> None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        note = "no NVIDIA driver (libcuda.so.1) on this host: nothing to check"
        print(json.dumps({"driver": False, "missing": [], "cuda_version": "", "note": note}))
        return
    version = ctypes.c_int(0)
    lib.cuDriverGetVersion(ctypes.byref(version))
    cuda = f"{version.value // 1000}.{version.value % 1000 // 10}"
    missing = [s for s in SYMBOLS if not hasattr(lib, s)]
    print(json.dumps({"driver": True, "missing": missing, "cuda_version": cuda,
                      "note": f"CUDA {cuda} driver offers the checkpoint API"}))


main()
