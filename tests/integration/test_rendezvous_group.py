"""A real gloo group started at a rendezvous its own process hosts (strategies/collective.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.integration
def test_a_group_joins_at_the_store_its_process_hosts():
    """rank 0's process hosts the rendezvous (`host_rendezvous`) and its group takes that store over."""
    from distrain.strategies import collective

    address = collective.host_rendezvous("127.0.0.1", 30.0)
    group = collective.CollectiveGroup(0, 1, address, "gloo", 30.0)
    try:
        assert address not in collective._HOSTED and group.store is not None
        t = torch.ones(4)
        group.all_reduce_mean_(t)
        assert torch.equal(t, torch.ones(4))
    finally:
        group.destroy()
