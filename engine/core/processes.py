"""Processes on this machine, for files that name the process that wrote them.

Example:
    >>> import os
    >>> alive(os.getpid())
    True
"""

from __future__ import annotations

import os


def alive(pid: object) -> bool:
    """Whether a process with this id runs on this machine (someone else's counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
