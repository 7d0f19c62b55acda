"""Finding and ending the local backend's processes, by pid and by the job marker they carry.

Every supervisor and worker runs in a process group of its own (``start_new_session``) and has
``SPOTSCHED_LOCAL_JOBDIR`` in its environment; a worker and every process it starts also carry
its instance's id (``SPOTSCHED_INSTANCE_ID``), which finds them once the worker itself exited.
A pid alone is not proof: after a crash it may have been recycled, so a process counts as ours
only if its start (:func:`create_time`) matches the record (within :data:`CREATE_TIME_TOLERANCE_S`).
A zombie (exited, not yet reaped by an init that does not reap) counts as gone.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterable

import psutil

JOBDIR_MARKER = "SPOTSCHED_LOCAL_JOBDIR"
JOB_ID_MARKER = "SPOTSCHED_JOB_ID"
INSTANCE_MARKER = "SPOTSCHED_INSTANCE_ID"
# On Linux psutil's create time is the boot time (whole seconds, reread from /proc/stat at every
# call) plus the start since boot (the kernel's clock ticks). Every step of the wall clock (NTP, a
# VM's clock catching up after a pause) moves the boot time, so a live process's create time moves
# by the step; its start since boot never moves, and is its identity there. A recycled pid needs
# the pid space to wrap around within the tolerance (or, after a reboot, a process of that pid
# started as long after boot, within the tolerance).
SINCE_BOOT = sys.platform.startswith("linux")
CREATE_TIME_TOLERANCE_S = 1.5


def create_time(pid: int) -> float | None:
    """The process's start, the second half of its identity (None if it is gone): on Linux in
    seconds since boot, which no step of the wall clock moves, elsewhere psutil's create time."""
    try:
        return _start(psutil.Process(pid))
    except psutil.Error:
        return None


def _start(process: psutil.Process) -> float:
    boot = psutil.boot_time() if SINCE_BOOT else 0.0  # read first: psutil 5.9 adds the boot time it read last
    return process.create_time() - boot


def is_alive(pid: int | None, started: float | None) -> bool:
    """Whether the process ``pid`` started at ``started`` (:func:`create_time`) still runs (zombies do not).

    A record written before starts were kept since boot holds the wall-clock create time, which
    still matches (its process stays ours unless the wall clock was stepped since)."""
    if pid is None or started is None:
        return False
    try:
        process = psutil.Process(pid)
        same = any(abs(value - started) < CREATE_TIME_TOLERANCE_S for value in (_start(process), process.create_time()))
        return same and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_group(pid: int, started: float | None, signum: int) -> None:
    """Send ``signum`` to the process group led by ``pid`` (or to ``pid`` alone if it leads none), if
    that process is still ours, and to each of its descendants: torchrun starts its workers in
    sessions of their own, out of the group's reach."""
    if not is_alive(pid, started):
        return
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:  # not a group leader (a worker's child left behind by its parent): signal it alone
            os.kill(pid, signum)
    except ProcessLookupError:
        return
    except PermissionError:
        os.kill(pid, signum)
    for process in descendants:
        try:
            process.send_signal(signum)
        except psutil.Error:
            continue


def marked(jobdir: str, instance_id: str | None = None) -> list[psutil.Process]:
    """Every live process whose environment carries ``jobdir`` as its job marker (and ``instance_id``
    as its instance, if given: the processes of that instance's worker, its children included)."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            env = process.environ()
            if env.get(JOBDIR_MARKER) == jobdir and (instance_id is None or env.get(INSTANCE_MARKER) == instance_id):
                found.append(process)
        except psutil.Error:
            continue
    return found


def end_all(processes: Iterable[psutil.Process], timeout_s: float) -> None:
    """SIGTERM each process's group, wait up to ``timeout_s``, then SIGKILL what is left."""
    processes = list(processes)
    for process in processes:
        try:
            signal_group(process.pid, process.create_time(), signal.SIGTERM)
        except psutil.Error:
            continue
    _, left = psutil.wait_procs(processes, timeout=timeout_s)
    for process in left:
        try:
            signal_group(process.pid, process.create_time(), signal.SIGKILL)
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=5.0)


def wait_gone(pid: int, started: float | None, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until the process is gone; False if it still runs after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while is_alive(pid, started):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: each worker generation rendezvouses on a fresh one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
