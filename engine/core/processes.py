"""Processes on this machine, for files that name the process that wrote them.

Example:
    >>> import os
    >>> alive(os.getpid())
    True
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


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


def machine_key() -> str:
    """What tells this machine (and pid namespace) from others sharing a lakehouse: the host
    name, systemd's machine id, the kernel's boot id and the pid namespace. Two processes
    with the same key can check each other's pids.

    Example:
        >>> machine_key() == machine_key()
        True
    """
    parts = [socket.gethostname()]
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            parts.append(Path(path).read_text().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return "/".join(parts)


def started(pid: int) -> int:
    """When process ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat``); 0 when
    unknown. With the pid it names one process, even after the pid is reused.

    Example:
        >>> started(os.getpid()) > 0
        True
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0
