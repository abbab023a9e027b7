"""Stage 4, topics -> applications: consumer groups, retries, dead letters, lag."""
