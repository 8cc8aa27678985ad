"""vLLM: the adapter, the CLI shim, the `vllm snapshot` backend, its rungs and doctor checks.

Nothing here imports vLLM: vLLM runs in its own interpreter, and these modules talk to
it through its command line and HTTP API.
"""
