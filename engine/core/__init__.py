"""What every stage shares and nothing else: configuration, levels, clock, errors, topic
names, the message model, Kafka header names. Imports no other engine package."""
