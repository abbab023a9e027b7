"""The engine's own state beside its tables: the lease (one engine per lakehouse) and the offset
logs (the delayOffset checkpoint, stamping's plans)."""
