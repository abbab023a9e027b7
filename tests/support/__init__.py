"""What tests share: lakehouse helpers, crash-injecting sinks, processes, the Kafka broker.

Tests import from here, never from each other."""
