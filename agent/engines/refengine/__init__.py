"""The reference engine: a small, real OpenAI-compatible server for a Llama model (CPU or GPU)."""
