"""Which process listens on a TCP port of this host: the one a "port already in use" error of the
rendezvous names. Looked up once the job has ended, for the crash verdict (`comm_errors`), when a
rank or the launcher died of such an error; the holder is often a rank of an earlier run that
still lives."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sddoctor.supervise.comm_errors import known_error

#: a port-in-use error names one or two ports; more would be a runaway log
_MOST_PORTS = 4


def taken_ports(messages: Iterable[str]) -> list[int]:
    """The ports that port-in-use errors among `messages` name, in the order first named."""
    ports: list[int] = []
    for message in messages:
        found = known_error(message)
        if found is not None and found.code == "port_in_use" and found.port and found.port not in ports:
            ports.append(found.port)
    return ports[:_MOST_PORTS]


def port_holders(messages: Iterable[str], run_started: float) -> dict[str, dict[str, Any]]:
    """{port: {pid, name, cmdline, started_before_run}} for each port a port-in-use error among
    `messages` names and a process of this host listens on (readable by this user)."""
    ports = taken_ports(messages)
    if not ports:
        return {}
    import psutil

    try:
        listening = [
            c
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and getattr(c.laddr, "port", None) in ports and c.pid
        ]
    except (psutil.Error, OSError):
        return {}
    found: dict[str, dict[str, Any]] = {}
    for conn in listening:
        key = str(getattr(conn.laddr, "port", ""))
        if key in found:
            continue
        try:
            process = psutil.Process(conn.pid)
            with process.oneshot():
                found[key] = {
                    "pid": conn.pid,
                    "name": process.name(),
                    "cmdline": process.cmdline()[:12],
                    "started_before_run": process.create_time() < run_started,
                }
        except psutil.Error:
            found[key] = {"pid": conn.pid}
    return found
