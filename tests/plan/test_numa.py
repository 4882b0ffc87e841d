"""NUMA binding degrades step by step when the host refuses, and always reports what is in force."""

from __future__ import annotations

import errno

from strata.runtime.plan.numa import Binding, bind_to_node, numa_nodes, parse_cpulist

TWO_NODES = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}


def refuse(*_):
    raise OSError(errno.EPERM, "Operation not permitted")


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []


def test_memory_preferred_when_allowed():
    calls = []
    b = bind_to_node(1, TWO_NODES, set_mempolicy=lambda n: calls.append(("mem", n)),
                     set_affinity=lambda c: calls.append(("cpu", tuple(c))))
    assert b.mode == "memory-preferred" and b.node == 1 and b.cpus == [4, 5, 6, 7]
    assert calls == [("cpu", (4, 5, 6, 7)), ("mem", 1)]
    assert "node 1" in b.describe() and "4-7" in b.describe()


def test_falls_back_to_cpu_only_when_memory_policy_is_refused():
    b = bind_to_node(0, TWO_NODES, set_mempolicy=refuse, set_affinity=lambda c: None)
    assert b.mode == "cpu-only" and b.cpus == [0, 1, 2, 3] and "memory policy refused" in b.reason


def test_none_when_everything_is_refused():
    b = bind_to_node(0, TWO_NODES, set_mempolicy=refuse, set_affinity=refuse)
    assert b.mode == "none" and "refused" in b.describe()


def test_single_node_and_unknown_hosts_start_cleanly(tmp_path):
    assert bind_to_node(0, {0: [0, 1]}).mode == "none"
    assert bind_to_node(0, {}).describe() == "NUMA: not bound (no NUMA information)"
    assert bind_to_node(None, TWO_NODES).mode == "none"
    assert numa_nodes(tmp_path) == {}
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text("0-1\n")
    assert numa_nodes(tmp_path) == {0: [0, 1]}


def test_real_host_is_probed_without_binding():
    b = bind_to_node(None)  # an unknown GPU node never binds, on any host
    assert isinstance(b, Binding) and b.mode == "none" and b.describe().startswith("NUMA:")
    assert all(isinstance(c, int) for cpus in numa_nodes().values() for c in cpus)
