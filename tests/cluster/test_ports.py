"""Free ports come from outside the kernel's ephemeral range (where other processes' bind(0) and
outgoing connections draw), are bindable, and are never handed out twice by one process."""

import socket

from cluster.ports import RAY_WORKER_PORTS_END, ephemeral_range_start, free_port


def test_free_ports_lie_below_the_ephemeral_range_bind_and_differ():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(RAY_WORKER_PORTS_END < port < ephemeral_range_start() for port in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_another_process_listens_on_is_passed_over(monkeypatch):
    import cluster.ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # not through free_port: as another process would
        taken.listen()
        in_use = taken.getsockname()[1]
        picks = iter([in_use, in_use, RAY_WORKER_PORTS_END + 7])
        monkeypatch.setattr(cluster.ports.random, "randint", lambda low, high: next(picks))
        monkeypatch.setattr(cluster.ports, "_handed_out", set())
        assert free_port() == RAY_WORKER_PORTS_END + 7
