"""Stage 3, schedule -> topics: delivery rounds, exactly once, with the delayOffset checkpoint."""
