"""What a recurring schedule does with occurrences missed while no engine ran (its
``catch_up``), kept apart from the rest so that the command line's parser loads nothing else.

Example:
    >>> CATCH_UP
    ('skip', 'latest', 'all')
"""

SKIP, LATEST, ALL = "skip", "latest", "all"
#: ``skip``: none fires; ``latest``: the newest fires, once; ``all``: each one within the
#: schedule's catch-up window fires, spread out (``engine.recur.fire``).
CATCH_UP = (SKIP, LATEST, ALL)
#: After downtime, the newest missed occurrence fires once.
DEFAULT_CATCH_UP = LATEST
#: Missed occurrences older than this (before the grace) count as skipped, whatever the policy.
DEFAULT_CATCH_UP_WINDOW = "1d"
