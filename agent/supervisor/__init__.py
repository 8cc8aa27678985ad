"""The supervisor: walks the recovery ladder, watches the engine, restarts it."""
