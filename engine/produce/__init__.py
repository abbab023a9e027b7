"""Stage 1, -> commitlog: send from Python, a DataFrame or Kafka."""
