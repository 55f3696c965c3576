"""The host memory budget reads the memory cgroups the process runs in, found as the kernel names them
(/proc/self/cgroup, /proc/self/mountinfo), on a fake tree: v2 and v1, a container that mounts only its own cgroup, a
parent's tighter limit, and no limit at all. Inside a limited cgroup the budget is the cgroup's room, never the host's
larger figure, so a request that cannot fit in it is refused before anything is allocated."""

from __future__ import annotations

import pytest

from graph_runtime import free_memory
from graph_runtime.memory import GiB, MiB

V1_NO_LIMIT = 9223372036854771712


def fake_tree(tmp_path, cgroup_lines, mounts, files):
    """/proc/self (its cgroup and mountinfo) under tmp_path/proc, `mounts` (fstype, root, point, super options)
    with points under tmp_path, and `files` {path under tmp_path: text}."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    (proc / "mountinfo").write_text("".join(
        f"{30 + i} 23 0:{40 + i} {root} {tmp_path / point} rw,relatime - {fstype} {fstype} {options}\n"
        for i, (fstype, root, point, options) in enumerate(mounts)))
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text + "\n")
    return str(proc)


def test_cgroup_v2_limit_and_room_of_the_process_own_group(tmp_path):
    proc = fake_tree(tmp_path, ["0::/system.slice/comfyui.scope"], [("cgroup2", "/", "cg", "rw")], {
        "cg/system.slice/comfyui.scope/memory.max": str(3 * GiB),
        "cg/system.slice/comfyui.scope/memory.current": str(1 * GiB),
        "cg/system.slice/memory.max": "max", "cg/system.slice/memory.current": str(5 * GiB)})
    assert free_memory.cgroup_memory(proc) == (3 * GiB, 2 * GiB)


def test_a_parents_tighter_limit_bounds_the_room(tmp_path):
    proc = fake_tree(tmp_path, ["0::/a/b"], [("cgroup2", "/", "cg", "rw")], {
        "cg/a/b/memory.max": str(8 * GiB), "cg/a/b/memory.current": str(1 * GiB),
        "cg/a/memory.max": str(2 * GiB), "cg/a/memory.current": str(1536 * MiB)})
    assert free_memory.cgroup_memory(proc) == (2 * GiB, 512 * MiB)


def test_cgroup_v1_in_a_container_that_mounts_only_its_own_group(tmp_path):
    """Docker on cgroup v1: /proc/self/cgroup names /docker/<id>, and the memory hierarchy is mounted with that
    group as its root, so the limit file sits at the mount point itself."""
    proc = fake_tree(tmp_path, ["5:cpu,cpuacct:/docker/abc", "4:memory:/docker/abc", "0::/"],
                     [("cgroup", "/docker/abc", "sys/memory", "rw,memory"),
                      ("cgroup", "/docker/abc", "sys/cpu", "rw,cpu,cpuacct")], {
        "sys/memory/memory.limit_in_bytes": str(3 * GiB), "sys/memory/memory.usage_in_bytes": str(GiB // 2),
        "sys/cpu/memory.limit_in_bytes": str(GiB)})  # not a memory hierarchy: never read
    assert free_memory.cgroup_memory(proc) == (3 * GiB, 3 * GiB - GiB // 2)


def test_cgroup_v1_on_a_host_with_the_groups_path_under_the_mount(tmp_path):
    proc = fake_tree(tmp_path, ["4:memory:/process_api/x"], [("cgroup", "/", "sys/memory", "rw,memory")], {
        "sys/memory/memory.limit_in_bytes": str(V1_NO_LIMIT), "sys/memory/memory.usage_in_bytes": str(9 * GiB),
        "sys/memory/process_api/x/memory.limit_in_bytes": str(4 * GiB),
        "sys/memory/process_api/x/memory.usage_in_bytes": str(3 * GiB)})
    assert free_memory.cgroup_memory(proc) == (4 * GiB, 1 * GiB)


def test_no_limit_anywhere_is_no_cgroup_figure(tmp_path):
    proc = fake_tree(tmp_path, ["4:memory:/", "0::/"],
                     [("cgroup", "/", "m", "rw,memory"), ("cgroup2", "/", "u", "rw")], {
        "m/memory.limit_in_bytes": str(V1_NO_LIMIT), "m/memory.usage_in_bytes": str(GiB),
        "u/memory.max": "max", "u/memory.current": str(GiB)})
    assert free_memory.cgroup_memory(proc) is None
    assert free_memory.cgroup_memory(str(tmp_path / "absent")) in (None, free_memory.cgroup_memory())


@pytest.fixture
def host_22_gib_in_a_3_gib_cgroup(tmp_path, monkeypatch):
    """A host reporting 22.3 GiB available and 31 GiB of RAM (/proc/meminfo: psutil hidden), the process in a cgroup
    of 3 GiB using 2 GiB."""
    import sys

    proc = fake_tree(tmp_path, ["0::/docker/abc"], [("cgroup2", "/docker/abc", "cg", "rw")], {
        "cg/memory.max": str(3 * GiB), "cg/memory.current": str(2 * GiB)})
    monkeypatch.setattr(free_memory, "PROC_SELF", proc)
    monkeypatch.setitem(sys.modules, "psutil", None)
    monkeypatch.setattr(free_memory, "_meminfo", {"MemTotal:": 31 * GiB, "MemAvailable:": int(22.3 * GiB)}.get)


def test_the_host_budget_is_the_cgroups_room_not_the_hosts(host_22_gib_in_a_3_gib_cgroup):
    from graph_runtime import memory

    assert free_memory.host_available_bytes() == 1 * GiB
    assert free_memory.host_total_bytes() == 3 * GiB
    assert memory.available_bytes("cpu") == 1 * GiB


def test_a_cpu_request_the_cgroup_cannot_hold_is_refused_before_it_runs(host_22_gib_in_a_3_gib_cgroup, tmp_path,
                                                                        capsys):
    """A 4096x4096 request on the CPU (the tiny model needs 1.4 GiB for it) in a 3 GiB cgroup with 1 GiB left:
    refused against the cgroup's 1 GiB, not admitted against the host's 22.3 GiB."""
    from graph_runtime.cli import main

    out = tmp_path / "big.png"
    assert main(["generate", "--width", "4096", "--height", "4096", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "1.0 GiB is available" in err and "22.3" not in err, err
    assert not out.exists()
