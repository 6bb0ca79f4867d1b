"""A run's collective group meets at a rendezvous store its rank-0 actor starts on a port the OS picks
(`host_rendezvous`): the port is held from the moment it is chosen, so no other process can take it."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from distrain.strategies import collective
from distrain.strategies.collective import host_rendezvous


def test_the_hosted_port_is_held_until_the_group_starts():
    address = host_rendezvous("127.0.0.1", 10.0)
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError) as taken:
            s.bind((host, int(port)))  # what another process's free port, bound later, would have tried
        assert taken.value.errno == errno.EADDRINUSE
        # ... and it is a live store the other ranks reach
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert collective._HOSTED[address].get("k") == b"v"
    finally:
        collective._HOSTED.pop(address, None)
