"""Stage 2, commitlog -> schedule: stamp each message with its deliver time."""
