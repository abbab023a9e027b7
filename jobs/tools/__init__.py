"""Tools that ship with the project but are not part of the library: the benchmark behind
``make bench`` and the local Kafka broker behind ``make kafka-up``."""
