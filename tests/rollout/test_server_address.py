"""Server mode's weight-update address: routable, overridable, loopback refused for remote servers / many nodes."""

from __future__ import annotations

import socket

import pytest

from megatron_dapo import launch_env
from megatron_dapo.config import ConfigError
from megatron_dapo.config import RolloutConfig
from megatron_dapo.launch_env import num_nodes
from megatron_dapo.launch_env import weight_sync_master_address
from megatron_dapo.net import is_loopback
from megatron_dapo.rollout.factory import make_engine

REMOTE = ["http://node7:30000", "http://node8:30000"]
LOCAL = ["http://127.0.0.1:30000"]


def test_is_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("10.0.0.5", "node7", "192.168.1.2", "fe80::1"))


@pytest.mark.parametrize(
    "configured, urls, nodes, why",
    [
        ("127.0.0.1", REMOTE, 1, "server node7 is not local"),
        ("localhost", LOCAL, 2, "spans 2 nodes"),
        ("127.0.1.1", ["node8:30000"], 4, "server node8 is not local"),
    ],
)
def test_loopback_refused_for_remote_servers_or_many_nodes(configured, urls, nodes, why):
    with pytest.raises(ValueError, match=f"^rollout.weight_sync_master_address: .*{why}") as info:
        weight_sync_master_address(configured, urls, nodes)
    assert "\n" not in str(info.value)


def test_configured_address_wins_and_local_single_node_uses_loopback():
    assert weight_sync_master_address("10.0.0.5", REMOTE, 4) == "10.0.0.5"
    assert weight_sync_master_address("", LOCAL, 1) == "127.0.0.1"
    assert weight_sync_master_address("127.0.0.1", LOCAL, 1) == "127.0.0.1"


def test_detection_routes_toward_the_first_remote_server(monkeypatch):
    seen = []

    def fake_local_address(toward=None):
        seen.append(toward)
        return "10.9.8.7"

    monkeypatch.setattr(launch_env, "local_address", fake_local_address)
    assert weight_sync_master_address("", LOCAL + REMOTE, 1) == "10.9.8.7"
    assert seen == ["node7"]


def test_detection_that_finds_only_loopback_is_refused(monkeypatch):
    """A host whose /etc/hosts maps its name to 127.0.1.1 and no route to the server: refused, not sent."""

    class NoRoute(socket.socket):
        def connect(self, address):
            raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "socket", NoRoute)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert launch_env.local_address("node7") == "127.0.1.1"
    with pytest.raises(ValueError, match="'127.0.1.1' is a loopback address but server node7 is not local"):
        weight_sync_master_address("", REMOTE, 1)


def test_num_nodes_from_torchrun_or_slurm():
    assert num_nodes(32, {"LOCAL_WORLD_SIZE": "8"}) == 4
    assert num_nodes(4, {"SLURM_NNODES": "2"}) == 2
    assert num_nodes(1, {}) == 1


def test_config_refuses_loopback_with_remote_servers():
    with pytest.raises(ConfigError, match="rollout.weight_sync_master_address: '127.0.0.1' is a loopback"):
        RolloutConfig(engine="sglang", mode="server", server_urls=REMOTE, weight_sync_master_address="127.0.0.1")
    RolloutConfig(engine="sglang", mode="server", server_urls=LOCAL, weight_sync_master_address="127.0.0.1")
    with pytest.raises(ConfigError, match="weight_sync_master_port"):
        RolloutConfig(engine="sglang", mode="server", server_urls=LOCAL, weight_sync_master_port=70000)


def test_make_engine_sends_a_routable_address(monkeypatch):
    """The trainer passes no address: make_engine resolves it (before this fix, servers were sent 127.0.0.1)."""
    monkeypatch.setattr(launch_env, "local_address", lambda toward=None: "10.9.8.7")
    rollout = RolloutConfig(engine="sglang", mode="server", server_urls=REMOTE, weight_sync_master_port=29611)
    eng = make_engine(rollout, "/unused", device="cpu")
    assert (eng.master_address, eng.master_port) == ("10.9.8.7", 29611)
    rollout = RolloutConfig(engine="sglang", mode="server", server_urls=REMOTE, weight_sync_master_address="node0")
    assert make_engine(rollout, "/unused", device="cpu").master_address == "node0"
    monkeypatch.setattr(launch_env, "local_address", lambda toward=None: "127.0.1.1")
    rollout = RolloutConfig(engine="sglang", mode="server", server_urls=REMOTE)
    with pytest.raises(ValueError, match="rollout.weight_sync_master_address"):
        make_engine(rollout, "/unused", device="cpu")
