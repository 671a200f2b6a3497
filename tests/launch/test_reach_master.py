"""The launcher's choice of this node's address and interface for a job of several machines
(``paddle_hybrid/launch/network.py``), without processes: the route's source and its interface on
this machine's loopback, the rules (the user's ``--host`` / ``POD_IP`` / ``GLOO_SOCKET_IFNAME`` win;
nothing for a loopback, ``etcd://`` or absent master), the wait for a route within the deadline,
and where the choice goes in the command.  Across two network namespaces:
``test_several_machines.py``.

Seen failing first: ``paddle_hybrid.launch.network`` did not exist; the launcher passed the user's
arguments alone, and Paddle's launcher took the host name's address."""
import errno
import time

import pytest

from paddle_hybrid import launch as ph_launch
from paddle_hybrid.launch import network


def _args(argv):
    return ph_launch._parse_with_paddle([*argv, "train.py"])


def test_the_route_and_its_interface_on_loopback():
    assert network.route_source("127.0.0.1") == "127.0.0.1"
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.interface_of("192.0.2.255") is None  # held by no interface here
    assert network.master_address("localhost:8090") == "127.0.0.1"
    assert network.master_address("etcd://10.0.0.1:2379") is None and network.master_address(None) is None


def _reach(monkeypatch, argv, environ=None, route="10.201.0.2", interfaces=None, timeout=5.0):
    interfaces = {"10.201.0.2": "eth1", "10.201.0.1": "eth0"} if interfaces is None else interfaces
    monkeypatch.setattr(network, "route_source", lambda address: route)
    monkeypatch.setattr(network, "interface_of", lambda address: interfaces.get(address))
    lines = []
    return network.reach_master(_args(argv), environ or {}, timeout, log=lines.append), lines


def test_the_route_chooses_and_the_user_wins(monkeypatch):
    master = ["--nnodes", "2", "--master", "10.201.0.1:6170"]
    reach, _ = _reach(monkeypatch, master)
    assert reach.launcher_arguments() == ["--host", "10.201.0.2"]
    assert reach.environment() == {"GLOO_SOCKET_IFNAME": "eth1"}
    assert "reaches the master 10.201.0.1 from 10.201.0.2 (eth1, the route to 10.201.0.1)" in reach.describe()
    # the master's own node: its address is the master's
    reach, _ = _reach(monkeypatch, master, route="10.201.0.1")
    assert reach.launcher_arguments() == ["--host", "10.201.0.1"] and "the master's own address" in reach.describe()
    # the user's address: kept, and its interface given to gloo
    reach, _ = _reach(monkeypatch, [*master, "--host", "10.201.0.1"])
    assert reach.launcher_arguments() == [] and reach.environment() == {"GLOO_SOCKET_IFNAME": "eth0"}
    reach, _ = _reach(monkeypatch, master, environ={"POD_IP": "10.201.0.1"})  # Paddle reads it over --host
    assert reach.launcher_arguments() == [] and reach.environment() == {"GLOO_SOCKET_IFNAME": "eth0"}
    # the user's interface: kept; the address still follows the route
    reach, _ = _reach(monkeypatch, master, environ={"GLOO_SOCKET_IFNAME": "ib0"})
    assert reach.launcher_arguments() == ["--host", "10.201.0.2"] and reach.environment() == {}
    # both given, or a master that needs nothing: nothing changes
    assert _reach(monkeypatch, [*master, "--host", "10.0.0.9"], environ={"GLOO_SOCKET_IFNAME": "ib0"})[0] is None
    for argv in (["--nnodes", "2", "--master", "127.0.0.1:6170"], ["--master", "etcd://10.0.0.1:2379"],
                 ["--nproc_per_node", "2"]):
        assert _reach(monkeypatch, argv)[0] is None, argv
    assert _reach(monkeypatch, ["--nproc_per_node", "2"], environ={"PADDLE_MASTER": "127.0.0.1:1"})[0] is None
    # an address no interface holds (the user's NAT address): gloo keeps its choice, and the line says so
    reach, _ = _reach(monkeypatch, [*master, "--host", "203.0.113.7"])
    assert reach.environment() == {} and "no interface of this machine holds 203.0.113.7" in reach.describe()


def _no_route_for(monkeypatch, tries):
    calls = []

    def route(address):
        calls.append(address)
        if len(calls) <= tries:
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        return "10.201.0.2"

    monkeypatch.setattr(network, "route_source", route)
    monkeypatch.setattr(network, "_RETRY_SECONDS", 0.05)
    monkeypatch.setattr(network, "interface_of", lambda address: "eth1")
    return calls


def test_a_node_without_a_route_waits_for_one(monkeypatch):
    calls = _no_route_for(monkeypatch, tries=3)
    lines = []
    reach = network.reach_master(_args(["--master", "10.201.0.1:6170"]), {}, 5.0, log=lines.append)
    assert reach.host == "10.201.0.2" and len(calls) == 4
    assert len(lines) == 1 and "no route from this node to the master 10.201.0.1 yet (Network is unreachable" in lines[0]


def test_a_node_without_a_route_gives_up_at_the_deadline_naming_the_fix(monkeypatch):
    _no_route_for(monkeypatch, tries=10 ** 6)
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        network.reach_master(_args(["--master", "10.201.0.1:6170"]), {}, 1.0, log=lambda line: None)
    assert 0.9 < time.monotonic() - started < 2.0
    message = str(stopped.value)
    assert "no route from this node to the master 10.201.0.1 after 1 s (PADDLE_HYBRID_TIMEOUT)" in message
    assert "give --host and GLOO_SOCKET_IFNAME yourself" in message


def test_the_choice_goes_before_the_script_and_into_the_workers_environment(monkeypatch, capsys):
    monkeypatch.setattr(network, "route_source", lambda address: "10.201.0.2")
    monkeypatch.setattr(network, "interface_of", lambda address: "eth1")
    argv = ["--nnodes", "2", "--master", "10.201.0.1:6170", "train.py", "--host", "script's"]
    arguments, environment = ph_launch.reach_the_master(_args(argv[:4]), {})
    assert arguments == ["--host", "10.201.0.2"] and environment == {"GLOO_SOCKET_IFNAME": "eth1"}
    assert "paddle_hybrid.launch: this node reaches the master 10.201.0.1 from 10.201.0.2" in capsys.readouterr().err
    full = ph_launch._parse_with_paddle([*arguments, *argv])
    assert full.host == "10.201.0.2" and full.training_script_args == ["--host", "script's"]
