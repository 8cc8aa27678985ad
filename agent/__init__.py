"""Pitstop: restore vLLM from CRIU + CUDA checkpoints instead of loading it again."""

__version__ = "0.1.0"
