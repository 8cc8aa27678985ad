"""The ladder's paths, one module each."""
