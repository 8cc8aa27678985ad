"""The tenant's side of the holder: held regions mapped at fixed addresses, held weights.

Engines import this inside their own interpreter (the reference engine, and the vLLM
plugin); the agent itself never maps held memory.
"""
