"""localnode's pod IP blocks: an octet whose addresses still have a bound TCP socket (a pod's
process that outlived its localnode) is not handed out again, though its lock is free."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.cluster.localnode import octets_with_sockets, reserve_ip_octet


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
