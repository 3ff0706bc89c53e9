"""A memory cgroup per rank (grading/isolation/rank_cgroups.py): what the grader's reading of a rank counts.

* Memory moved out of every process of a rank between pauses (a file in /dev/shm, a file in its
  TMPDIR, a double-forked helper, pipe buffers, loopback TCP buffers) shows in the reading,
  where the rank's resident memory misses it; the helper dies with its test.
* A rank's uid cannot move itself out of its cgroup.
* The files of cgroup v2 and v1 are read alike (a folder standing in for the cgroup).

The first two are skipped where this grader may make no cgroup.
"""

from __future__ import annotations

import os
import signal

import pytest

from grading.readings import outside
from grading.readings.memory import MB

pytestmark = pytest.mark.problem("beyond")


def _moves_memory_out(ctx, job) -> dict:
    """Rank side: after its first pause, 8 MB at a time moved out of every process of the rank's
    tree, one way per pause, and kept there: a file in /dev/shm (tmpfs), a file in its TMPDIR (page
    cache), a helper that double-forked (reparented, in a session of its own), pipe buffers, and
    (at least 8 MB) loopback TCP buffers."""
    import fcntl
    import tempfile

    ctx.pause(outside.BEFORE)
    size, files, kept_fds = 8 * MB, [], []
    try:
        for where in (f"/dev/shm/grading-test-{os.getpid()}", os.path.join(tempfile.gettempdir(), f"grading-test-{os.getpid()}")):
            with open(where, "wb") as f:
                f.write(os.urandom(size))
            files.append(where)
            ctx.pause(f"after step {len(files)}")
        data, ack = os.pipe(), os.pipe()
        child = os.fork()
        if child == 0:  # the helper: leaves the rank's tree, reads the bytes and keeps them until killed
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            held = bytearray()
            while len(held) < size:
                held += os.read(data[0], size - len(held))
            os.write(ack[1], str(os.getpid()).encode())
            while True:
                signal.pause()
        os.waitpid(child, 0)
        view = memoryview(os.urandom(size))
        while view:
            view = view[os.write(data[1], view):]
        helper = int(os.read(ack[0], 64))
        del view
        ctx.pause("after step 3")
        for _ in range(8):  # 1 MB in each pipe's buffer (the default largest pipe an unprivileged user may make)
            r, w = os.pipe()
            fcntl.fcntl(w, 1031, MB)  # F_SETPIPE_SZ
            os.set_blocking(w, False)
            os.write(w, os.urandom(MB))
            kept_fds += [r, w]
        ctx.pause("after step 4")
        import socket

        for _ in range(4):  # loopback TCP buffers, sent until the sender would block (about 4 MB each)
            server = socket.create_server(("127.0.0.1", 0))
            sender = socket.create_connection(server.getsockname())
            receiver, _ = server.accept()
            sender.setblocking(False)
            try:
                while True:
                    sender.send(os.urandom(1 << 16))
            except BlockingIOError:
                pass
            kept_fds.append((server, sender, receiver))
        ctx.pause("after step 5")
        return {"helper": helper}
    finally:
        for where in files:
            os.unlink(where)


def test_memory_moved_out_of_the_rank_is_counted():
    """With a memory cgroup per rank, each 8 MB moved out of the rank's processes between pauses
    shows in the grader's reading (at least 7.5 MB more at each pause), where the rank's resident
    memory misses all five; the helper is killed with the test's ranks. Skipped where this
    grader may make no cgroup (the readings are then the resident memory alone)."""
    from grading.isolation import rank_cgroups, wire
    from grading.isolation.ranks import run_ranks

    if rank_cgroups.RankCgroups.make(1) is None:
        pytest.skip("no memory cgroup can be made here: ranks are read from /proc alone")
    (report,) = run_ranks(_moves_memory_out, 1, [wire.encode({})], timeout_s=60)
    readings = report[outside.KEY]
    assert [r["label"] for r in readings] == [outside.BEFORE] + [f"after step {s}" for s in range(1, 6)], readings
    assert all(r["source"].startswith("cgroup v") for r in readings), readings
    for before, after in zip(readings, readings[1:]):
        assert after["bytes"] - before["bytes"] >= 7.5 * MB, (after["label"], readings)
        assert after["resident"] - before["resident"] < 2 * MB, (after["label"], readings)
    # killed: gone, or a zombie until init reaps it
    assert outside._state(report["helper"]) in ("gone", "Z"), "the double-forked helper outlived its test"


def test_a_rank_cannot_leave_its_cgroup():
    """A process of another uid than the grader's (as ranks run when the grader is root) cannot
    move itself out of its rank's cgroup: into its parent, into the grader's own, or the root."""
    from grading.isolation import rank_cgroups

    if os.geteuid() != 0:
        pytest.skip("ranks run as another uid only when the grader is root")
    groups = rank_cgroups.RankCgroups.make(1)
    if groups is None:
        pytest.skip("no memory cgroup can be made here")
    try:
        root = rank_cgroups.CGROUP if groups.kind == "cgroup v2" else rank_cgroups.V1_MEMORY
        targets = [groups.folders[0].parent, groups.folders[0].parents[1], root]
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                groups.enter(0, os.getpid())
                os.setgroups([])
                os.setresgid(1_799_999_999, 1_799_999_999, 1_799_999_999)
                os.setresuid(1_799_999_999, 1_799_999_999, 1_799_999_999)
                for n, target in enumerate(targets, 1):
                    try:
                        with open(target / "cgroup.procs", "w") as f:
                            f.write(str(os.getpid()))
                        code = n
                    except OSError:
                        pass
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, f"moved itself into {targets[os.waitstatus_to_exitcode(status) - 1]}"
    finally:
        groups.close()


@pytest.mark.parametrize("kind, files", [
    ("cgroup v2", {"memory.current": "50000000\n", "memory.peak": "60000000\n",
                   "memory.stat": "anon 40000000\nfile 3000000\nkernel 2000000\nsock 1000000\nshmem 500\n"}),
    ("cgroup v1", {"memory.usage_in_bytes": "49000000\n", "memory.max_usage_in_bytes": "60000000\n",
                   "memory.kmem.usage_in_bytes": "2000000\n", "memory.kmem.tcp.usage_in_bytes": "1000000\n",
                   "memory.stat": "cache 3000000\nrss 40000000\ntotal_cache 3000000\ntotal_rss 40000000\n"}),
])
def test_a_rank_cgroup_is_read_alike_on_v1_and_v2(tmp_path, kind, files):
    """Each version's files, as the kernel writes them (a folder standing in for the cgroup): the
    judged bytes are the whole charge (v1 adds its TCP counter, which its usage leaves out); its
    parts are kept beside it, and ``parts`` (the second witness) is the resident anonymous memory
    of the processes listed in it plus its page cache, kernel and socket charges."""
    from grading.isolation import rank_cgroups

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "cgroup.procs").write_text(f"{os.getpid()}\n")
    reading = rank_cgroups.RankCgroups(kind, [tmp_path]).read(0)
    anon = rank_cgroups.memory_kb(os.getpid())["RssAnon"] << 10
    assert reading["source"] == kind and reading["processes"] == 1 and reading["peak"] == 60_000_000
    assert abs(reading["parts"] - (anon + 6_000_000)) < 4 * MB, reading  # this process's RssAnon moves a little
    assert reading["bytes"] == 50_000_000 and (reading["file"], reading["kernel"], reading["sock"]) == (3e6, 2e6, 1e6)
    assert reading["anon_charged"] == 40_000_000


def _allocates(ctx, job) -> dict:
    """Rank side: 256 MB, touched."""
    kept = bytearray(256 * MB)
    for i in range(0, len(kept), 4096):
        kept[i] = 1
    return {"kept": len(kept)}


def test_a_rank_over_its_memory_bound_fails_with_the_bound_named(monkeypatch):
    """Each rank's cgroup has a memory limit (here lowered to 64 MB): a rank that allocates past it
    is killed there, and the test's line names the bound, not only the signal."""
    from grading.isolation import rank_cgroups, wire
    from grading.isolation.ranks import RankFailure, run_ranks

    if rank_cgroups.RankCgroups.make(1) is None:
        pytest.skip("no memory cgroup can be made here: no per-rank limit")
    monkeypatch.setattr(rank_cgroups, "RANK_MEMORY_BYTES", 64 * MB)
    with pytest.raises(RankFailure, match="its memory cgroup reached the grader's bound"):
        run_ranks(_allocates, 1, [wire.encode({})], timeout_s=60)


def test_a_process_whose_main_thread_left_is_read_from_its_threads(tmp_path):
    """A helper whose main thread called pthread_exit while a second thread keeps the state shows
    no memory lines in its own status file (the kernel's, for a leader gone while its threads run
    on: a stand-in folder here, as the kernel writes it); they are read from its threads."""
    from grading.isolation import rank_cgroups

    leader = "Name:\tpython\nState:\tZ (zombie)\nTgid:\t77\nThreads:\t2\n"
    thread = leader.replace("Z (zombie)", "S (sleeping)") + "VmRSS:\t  40000 kB\nRssAnon:\t  33000 kB\nRssShmem:\t 0 kB\n"
    (tmp_path / "77" / "task" / "77").mkdir(parents=True)
    (tmp_path / "77" / "task" / "78").mkdir()
    (tmp_path / "77" / "status").write_text(leader)
    (tmp_path / "77" / "task" / "77" / "status").write_text(leader)
    (tmp_path / "77" / "task" / "78" / "status").write_text(thread)
    assert rank_cgroups.memory_kb(77, str(tmp_path)) == {"RssAnon": 33000, "RssShmem": 0}
