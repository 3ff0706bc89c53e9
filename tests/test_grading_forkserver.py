"""A fork server that refuses ranks costs no test: the ranks start from a fresh one.

Under heavy load a grading run's fork server was seen alive with its socket closed (dying, not
yet reaped), and every test started in that window failed with ConnectionRefusedError: the
correct fixture lost 5 of 35 points. Here the server's socket is replaced by one nobody listens
on (what a dying server leaves), and the next test's ranks must still run.
"""

from __future__ import annotations

import os
import socket
from multiprocessing import forkserver

import pytest

from grading import wire
from grading.ranks import Rank, run_ranks

pytestmark = pytest.mark.problem("beyond")


def _rank_and_server(ctx: Rank, job: dict) -> dict:
    return {"rank": ctx.rank, "server": os.getppid()}


def test_ranks_start_from_a_fresh_server_when_the_old_one_refuses():
    payloads = [wire.encode({})] * 2
    first = run_ranks(_rank_and_server, 2, payloads, timeout_s=120)
    address = forkserver._forkserver._forkserver_address
    os.unlink(address)
    with socket.socket(socket.AF_UNIX) as dead:  # bound, never listening: connect is refused
        dead.bind(address)
    with pytest.raises(ConnectionRefusedError), socket.socket(socket.AF_UNIX) as probe:
        probe.connect(address)
    second = run_ranks(_rank_and_server, 2, payloads, timeout_s=120)
    assert [r["rank"] for r in second] == [0, 1]
    assert {r["server"] for r in second}.isdisjoint({r["server"] for r in first})
