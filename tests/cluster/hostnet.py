"""The machine's own address: what a node registers and what the API server advertises to pods.

Pods cannot reach loopback on the host, so a control plane that pods talk to (through the
``kubernetes`` Service) binds and advertises this address instead.
"""

from __future__ import annotations

import shutil
import subprocess


def first_global_ipv4(ip_addr_output: str) -> str | None:
    """The first address of ``ip -4 -o addr show scope global`` output, or None."""
    for line in ip_addr_output.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


def host_ip() -> str | None:
    """This machine's first global IPv4 address (None when it has none, or no ``ip``)."""
    if shutil.which("ip") is None:
        return None
    proc = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=False,
    )
    return first_global_ipv4(proc.stdout) if proc.returncode == 0 else None
