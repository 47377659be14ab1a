"""The CPUs this process may use (``melcache/host/cpus.py``): affinity mask and cgroup quota, and the
default worker counts of the build and the loader that follow them (issue #41)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from melcache.host.cpus import Allotment, allotment, cgroup_quota
from tests.support.helpers import REPO, SAMPLE_CORPUS, build_command


def test_the_smaller_bound_wins_and_a_fraction_rounds_down() -> None:
    assert Allotment(8, None).cpus == 8
    assert Allotment(8, 2.5).cpus == 2
    assert Allotment(2, 6.0).cpus == 2
    assert Allotment(4, 0.5).cpus == 1  # a sliver of quota still runs one worker
    assert Allotment(4, 2.5).describe() == "affinity mask 4, cgroup quota 2.5"


def test_cgroup_v2_quota_is_the_smallest_on_the_path(tmp_path: Path) -> None:
    """``cpu.max`` of the process's cgroup and of its parents: a parent's limit binds."""
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "job" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "job" / "step" / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(["0::/job/step"], tmp_path) == 3.0
    assert cgroup_quota(["0::/elsewhere"], tmp_path) is None  # only max on the root


def test_cgroup_v1_quota_and_a_container_that_sees_only_its_root(tmp_path: Path) -> None:
    mount = tmp_path / "cpu,cpuacct"
    mount.mkdir()
    (mount / "cpu.cfs_quota_us").write_text("150000\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    # The host's path of the container's cgroup does not exist inside it: its root counts.
    lines = ["4:cpu,cpuacct:/docker/abc", "3:memory:/docker/abc", "1:name=systemd:/"]
    assert cgroup_quota(lines, tmp_path) == 1.5
    (mount / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cgroup_quota(lines, tmp_path) is None


def test_a_process_allotment_is_at_least_one_cpu() -> None:
    assert allotment().cpus >= 1


needs_taskset = pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")

PRINT_LOADER_DEFAULTS = """
from melcache.loader import DataConfig
from train.config.tables import load_config
print(DataConfig().num_workers, load_config(None).data.num_workers)
"""


@pytest.mark.slow
@needs_taskset
def test_under_taskset_one_cpu_the_loader_defaults_to_one_worker() -> None:
    """A real process pinned to CPU 0: the loader's and the trainer's [data] default is 1."""
    done = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", PRINT_LOADER_DEFAULTS],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["1", "1"]


@pytest.mark.slow
@needs_taskset
def test_under_taskset_one_cpu_the_build_defaults_to_one_worker(tmp_path: Path) -> None:
    """A real build pinned to CPU 0 says in its first line that it runs one worker, and its
    help shows the default it would take."""
    command = build_command(SAMPLE_CORPUS, tmp_path / "out", "--dry-run")
    done = subprocess.run(
        ["taskset", "-c", "0", *command],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    first = done.stderr.splitlines()[0]
    assert first.startswith("building the whole corpus of ")
    assert "workers 1 (the CPUs this process may use: affinity mask 1," in first
    shown = subprocess.run(
        ["taskset", "-c", "0", *command[:4], "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "here 1)" in " ".join(shown.stdout.split())
