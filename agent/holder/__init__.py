"""The memory holder: owns memory that outlives engines and hands it out as fds."""
