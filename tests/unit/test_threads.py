"""CPU threads: the count from what the process may use, and the tuner that adapts it."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig, available_cpus, cgroup_cpu_quota, default_threads
from tandem.worker.thread_tuner import ThreadTuner


def _cgroup(tmp_path, lines: str, files: dict[str, str]):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "self").write_text(lines)
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return cgroup_cpu_quota(root, tmp_path / "self")


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    assert _cgroup(tmp_path, "0::/a/b\n", {
        "cgroup.controllers": "cpu", "a/cpu.max": "150000 100000\n",
        "a/b/cpu.max": "max 100000\n"}) == 1.5


def test_cgroup_v1_quota_and_no_limit(tmp_path):
    assert _cgroup(tmp_path, "3:cpu,cpuacct:/docker/x\n", {
        "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "200000\n",
        "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}) == 2.0
    assert _cgroup(tmp_path / "none", "0::/\n", {"cgroup.controllers": "cpu",
                                                 "cpu.max": "max 100000\n"}) is None


def test_available_cpus_rounds_a_quota_down(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr("tandem.config.cgroup_cpu_quota", lambda: 2.5)
    assert available_cpus() == 2
    monkeypatch.setattr("tandem.config.cgroup_cpu_quota", lambda: 0.5)
    assert available_cpus() == 1
    monkeypatch.setattr("tandem.config.cgroup_cpu_quota", lambda: None)
    assert available_cpus() == 4


def test_engine_config_threads(monkeypatch):
    auto = EngineConfig()
    assert auto.num_threads == default_threads() and auto.adaptive_threads
    monkeypatch.setattr("tandem.config.available_cpus", lambda: 1)  # e.g. a 1-CPU quota
    assert EngineConfig().num_threads == 1
    fixed = EngineConfig(num_threads=3)
    assert fixed.num_threads == 3 and not fixed.adaptive_threads
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        EngineConfig(num_threads=0)


class _Machine:
    """A fake step whose duration depends on the thread count set, and the kernel's
    account of how long the threads waited for a CPU (high beside a neighbour)."""

    def __init__(self, cost: dict[int, float], wait: float) -> None:
        self.cost, self.wait = cost, wait
        self.threads, self.now, self.run_s, self.wait_s = max(cost), 0.0, 0.0, 0.0
        self.counts: list[int] = []

    def set(self, n: int) -> None:
        self.threads = n

    def clock(self) -> float:
        return self.now

    def times(self) -> tuple[float, float]:
        return self.run_s, self.wait_s

    def step(self) -> list[int]:
        dt = self.cost[self.threads]
        self.now += dt
        self.run_s += dt * self.threads
        self.wait_s += dt * self.threads * self.wait
        self.counts.append(self.threads)
        return [1]

    def tuner(self) -> ThreadTuner:
        return ThreadTuner(max(self.cost), self.set, self.clock, self.times)


QUIET = ({1: 0.037, 2: 0.023}, 0.06)  # step times at 1 and 2 threads; waited / run
NEIGHBOUR = ({1: 0.075, 2: 0.9}, 0.84)


def _run(m: _Machine, tuner: ThreadTuner, seconds: float) -> None:
    end = m.now + seconds
    while m.now < end:
        tuner.step(m.step)


def test_tuner_never_tries_fewer_threads_on_a_quiet_machine():
    m = _Machine(*QUIET)
    tuner = m.tuner()
    _run(m, tuner, 120)
    assert tuner.threads == 2 and set(m.counts) == {2}


def _tries_of_two(m: _Machine, since: int) -> tuple[int, int]:
    """(tries of 2 threads, steps run at 2) among the steps from ``since`` on."""
    c = m.counts[since - 1:]
    return sum(a == 1 and b == 2 for a, b in zip(c, c[1:])), c.count(2)


def test_tuner_drops_a_thread_beside_a_neighbour_and_climbs_back_when_it_leaves():
    m = _Machine(*NEIGHBOUR)
    tuner = m.tuner()
    _run(m, tuner, 10)
    assert tuner.threads == 1 and m.counts[-1] == 1
    start = len(m.counts)
    _run(m, tuner, 120)  # still waiting for CPUs: more threads are not tried
    assert tuner.threads == 1 and _tries_of_two(m, start) == (0, 0)
    m.wait = 0.1  # one thread waits little, the neighbour is still there
    start = len(m.counts)
    _run(m, tuner, 120)
    tries, steps = _tries_of_two(m, start)
    # Tried after 2, 4, 8, ... 60 s, each ended by its first (12x slower) step.
    assert tuner.threads == 1 and 3 <= tries <= 6 and steps == tries
    m.cost, m.wait = QUIET  # the neighbour left
    _run(m, tuner, 61)
    assert tuner.threads == 2


def test_tuner_without_a_wait_signal_tries_both_ways():
    m = _Machine(*NEIGHBOUR)
    tuner = ThreadTuner(2, m.set, m.clock, lambda: None)
    _run(m, tuner, 10)
    assert tuner.threads == 1


def test_tuner_ignores_idle_steps_and_restores_on_errors():
    m = _Machine(*QUIET)
    tuner = m.tuner()
    for _ in range(100):
        assert tuner.step(lambda: []) == []
    assert tuner._next_check is None  # nothing measured

    def boom():
        raise RuntimeError("step failed")

    tuner._probe = (1, [1.0], [])  # the other count's turn
    with pytest.raises(RuntimeError):
        tuner.step(boom)
    assert m.threads == 2


def test_cpu_times_reads_this_process():
    from tandem.worker.thread_tuner import cpu_times

    before = cpu_times()
    sum(i * i for i in range(200_000))
    after = cpu_times()
    assert before is not None and after[0] > before[0] and after[1] >= before[1]
