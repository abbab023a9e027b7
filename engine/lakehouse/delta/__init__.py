"""Delta tables from the driver: the log appender, delta-rs reads and appends in Arrow, live
files, checkpoints, and creating and migrating the engine's tables."""
