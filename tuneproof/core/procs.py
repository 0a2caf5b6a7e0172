"""Is a recorded process still running? For locks and leases that name their holder by pid.

    pid_alive(4242)       # False once it exited (a zombie awaiting its parent's wait() counts as exited)
    pid_space()           # 'host/boot-id/pid:[4026531836]': a recorded pid can be checked only in the same space

A pid means something only in the pid namespace of the boot that issued it: a container with the host's
hostname (host networking) or the same host after a reboot sees other processes under the same numbers.
"""

from __future__ import annotations

import os
import socket
from functools import cache


def pid_alive(pid: int) -> bool:
    """False when no process has `pid` here, or it is a zombie; another user's process counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return stat_state(f.read()) != "Z"
    except OSError:  # no /proc (macOS): kill(0) is all we know
        return True


def stat_state(stat: str) -> str:
    """The state letter of a /proc/<pid>/stat line. It follows the last ')': the command name before it may
    itself hold spaces and parentheses."""
    return stat.rpartition(")")[2].split()[0]


@cache
def pid_space() -> str:
    """Names the pid namespace and boot of this process; pids recorded under another name cannot be checked here."""
    return f"{socket.gethostname()}/{_read('/proc/sys/kernel/random/boot_id')}/{_pid_namespace()}"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
