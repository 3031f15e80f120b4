"""localnode's pod IP blocks: an octet whose addresses still have a bound TCP socket (a pod's
process that outlived its localnode) is not handed out again, though its lock is free; a pod's
process left behind is killed before its block is given back."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.cluster.localnode import (
    end_pod_processes,
    octets_with_sockets,
    pod_processes,
    reserve_ip_octet,
)


def test_proc_net_tcp_addresses_are_read_by_their_second_octet() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
        "   0: 04000B7F:C383 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0\n"
        "   1: 0100007F:1F90 0100007F:D2F2 01 00000000:00000000 00:00000000 00000000     0\n"
        "   2: 0A01A8C0:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0\n"
    )
    assert octets_with_sockets([table]) == {11, 0}  # 127.11.0.4, 127.0.0.1; not 192.168.1.10


def test_an_octet_with_a_bound_socket_is_passed_over() -> None:
    octet, locks = reserve_ip_octet(first=200)
    for lock in locks:
        lock.close()  # free again: what a localnode that died leaves
    leftover = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        leftover.bind((f"127.{octet}.0.2", 0))  # its pod's process, still bound
        leftover.listen()
        assert octet in octets_with_sockets([Path("/proc/net/tcp").read_text()])
        again, locks = reserve_ip_octet(first=octet)
        for lock in locks:
            lock.close()
        assert again != octet
    finally:
        leftover.close()
    after, locks = reserve_ip_octet(first=octet)
    for lock in locks:
        lock.close()
    assert after == octet


def test_a_pod_process_left_behind_is_killed_before_its_block_is_given_back() -> None:
    """A pod's process that outlived its localnode (or that it was starting as it stopped)
    would bind a podIP that the block's next owner hands out again."""
    octet, locks = reserve_ip_octet(first=200)
    other, other_locks = reserve_ip_octet(first=octet + 1)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    ours = subprocess.Popen([*sleeper, "--host", f"127.{octet}.0.2"])
    theirs = subprocess.Popen([*sleeper, f"--host=127.{other}.0.2"])
    try:
        assert ours.pid in pod_processes([octet]) and theirs.pid not in pod_processes([octet])
        assert end_pod_processes([octet]) == [ours.pid]
        assert ours.wait(timeout=5) == -signal.SIGKILL
        assert theirs.poll() is None  # another block's pod is left alone
        assert end_pod_processes([octet]) == []
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()
        for lock in [*locks, *other_locks]:
            lock.close()
