"""cluster/serve/launcher.py's local start: a node that dies starting (Ray's raylet aborts when its
dashboard agent misses the fixed 30 s wait for its ports, seen on a busy 2-core host) is started
again, the failed attempt's processes stopped; any other error is the caller's at once. ray.init
and ray.shutdown are stand-ins here (a real slow agent costs a minute); the processes are real."""

from __future__ import annotations

import subprocess

import psutil
import pytest
import ray

from cluster.serve import launcher


class FakeRay:
    def __init__(self, failures: list[Exception]):
        self.failures, self.calls, self.shutdowns, self.left_behind = failures, [], 0, []

    def init(self, **options):
        self.calls.append(options)
        if self.failures:
            # what a failed node start leaves: its processes, children of this one
            self.left_behind.append(subprocess.Popen(["sleep", "600"]))
            raise self.failures.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    def install(*failures):
        fake = FakeRay(list(failures))
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        return fake
    yield install


def timed_out() -> Exception:
    return Exception(f"{launcher.NODE_STARTUP_TIMEOUT}. This could happen because some of the raylet failed to startup")


def test_a_node_that_died_starting_is_started_again_and_its_processes_stopped(fake_ray):
    fake = fake_ray(timed_out(), timed_out())
    launcher.start_local_ray(num_cpus=2)
    assert fake.calls == [{"address": "local", "num_cpus": 2}] * 3 and fake.shutdowns == 2
    for process in fake.left_behind:
        assert process.wait(10) == -9  # killed, not left running beside the new cluster
    assert all(p.pid not in {q.pid for q in fake.left_behind} for p in psutil.Process().children(recursive=True))


def test_it_gives_up_after_its_last_start_and_other_errors_are_not_retried(fake_ray):
    fake = fake_ray(*[timed_out() for _ in range(launcher.LOCAL_STARTS)])
    with pytest.raises(Exception, match=launcher.NODE_STARTUP_TIMEOUT):
        launcher.start_local_ray()
    assert len(fake.calls) == launcher.LOCAL_STARTS
    fake.left_behind[-1].kill()

    fake = fake_ray(ValueError("num_cpus must be positive"))
    with pytest.raises(ValueError, match="num_cpus"):
        launcher.start_local_ray(num_cpus=-1)
    assert len(fake.calls) == 1 and fake.shutdowns == 0
    fake.left_behind[-1].kill()
