"""Each rank's policy, as data: what it may call, what it may reach, and what is read of it.

This module is the threat model. ``REFUSED`` is what the kernel refuses a rank: a seccomp filter,
built by ``install`` from that list through libseccomp (pyseccomp, a ctypes binding with
libseccomp's own Python API), as Docker, systemd and Flatpak confine their processes. A rank
loads it (ranks._rank_main) after it made its own storage and gave up its capabilities, before
the submission's first import, in every mode: it needs no privilege, only no_new_privs, which
``sandbox.confine`` sets, and Docker's default profile lets a process add filters of its own.
The filter covers every thread of the rank, those torch and gloo started before it included
(libseccomp's thread-sync attribute), and every process the rank starts. A refused call fails
with EPERM where it is made, so the student's own traceback names the call, whichever thread or
library made it. Calls refused ``GROUP_UP`` are refused by a second filter, stacked on the first
once the rank has joined its process group (the grader's own start needs them; nothing of the
submission has run by then).

Every refused call opens a channel between ranks that the grader does not read, or holds memory
outside what the grader reads of a rank; honest DDP, ZeRO and FSDP code makes none of them
(``tests/test_grading_policy.py`` grades the answers and reads the filter). ``GUARANTEES`` is the
grading manual's table "What each mode guarantees", row by row; ``python -m
grading.isolation.policy`` prints the two tables the manual holds, and a test requires the manual
to hold them exactly as printed.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

AT_START = "from the rank's start"
GROUP_UP = "once its group is up"

OPS = {"==": "EQ", "!=": "NE", ">": "GT", "&": "MASKED_EQ"}  # libseccomp's comparisons, by the names used here
MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20  # MAP_SHARED_VALIDATE (0x03) has the MAP_SHARED bit too
ALLOWED_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)  # and AF_NETLINK's routing protocol alone
NETLINK_ROUTE = 0
NAMESPACE_FLAGS = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                   "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                   "CLONE_NEWNET": 0x40000000}


@dataclass(frozen=True)
class Refused:
    """Calls the kernel refuses a rank, and why.

    ``where``: refused only where one of these rules holds (none: always refused); a rule is a
    tuple of comparisons that must all hold, each ``(argument, op, value)`` with ``op`` one of
    ``OPS``: ``("&", mask)`` is libseccomp's masked equality, ``argument & mask == value``;
    ``error``: the errno a refused call returns."""

    calls: tuple[str, ...]
    reason: str
    when: str = AT_START
    where: tuple[tuple[tuple[int, str | tuple[str, int], int], ...], ...] = ()
    condition: str = ""  # ``where`` in words, for the manual
    error: int = errno.EPERM


REFUSED: tuple[Refused, ...] = (
    Refused(("memfd_create", "memfd_secret"),
            "an anonymous file: its pages are in no file system the grader reads, and it passes to another "
            "process as a descriptor (issue 57's first route parked state in one)"),
    Refused(("splice", "vmsplice", "tee", "sendfile"),
            "a pipe that holds references to pages, not copies: what a file held stays in the pipe once the file "
            "is truncated, in no term a memory reading names (issue 57's first route); shutil and socket.sendfile "
            "fall back to copying"),
    Refused(("shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
             "msgget", "msgsnd", "msgrcv", "msgctl"),
            "System V shared memory, semaphores and message queues: without namespaces one object is shared by "
            "every rank of the uid, and it outlives the rank (a 512 MiB segment outlived a grading, issue 46)"),
    Refused(("mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr"),
            "POSIX message queues: a channel between ranks without namespaces, held in kernel memory"),
    Refused(("mmap",),
            "shared anonymous memory: shared with every process forked after it (issue 57's third route mapped "
            "it in the fork server), and its pages are shared memory, not the rank's own (file-backed shared maps "
            "stay: the rank's files are its storage, charged to it)",
            where=(((3, ("&", MAP_SHARED | MAP_ANONYMOUS), MAP_SHARED | MAP_ANONYMOUS),),),
            condition="flags with MAP_SHARED and MAP_ANONYMOUS"),
    Refused(("process_vm_readv", "process_vm_writev", "ptrace", "pidfd_getfd"),
            "another process's memory or descriptors (a peer rank's, or the grader's)"),
    Refused(("io_uring_setup", "io_uring_enter", "io_uring_register"),
            "an I/O ring: calls made by kernel workers that no audit hook sees, on buffers the kernel holds"),
    Refused(("userfaultfd",), "a rank's page faults answered by another process"),
    Refused(("bpf", "perf_event_open"),
            "kernel programs, maps and ring buffers: memory outside the rank's accounting, shared by descriptor"),
    Refused(("add_key", "request_key", "keyctl"),
            "the kernel's keyrings: the user keyring is one per uid, shared by every rank of a test, and "
            "charged to the uid's key quota, not to a rank"),
    Refused(("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
             "fsconfig", "fsmount", "fspick", "mount_setattr", "open_by_handle_at"),
            "the rank's namespaces and its view of the file systems are the grader's (sandbox.py): a view of its "
            "own would be one nobody reads"),
    Refused(("clone",), "a process in namespaces of its own (as unshare)",
            where=tuple(((0, ("&", flag), flag),) for flag in NAMESPACE_FLAGS.values()),
            condition="flags with any CLONE_NEW*"),
    Refused(("clone3",),
            "its flags are in memory a filter cannot read: glibc then starts threads and processes with clone, "
            "whose flags it can (Docker's default profile does the same)",
            error=errno.ENOSYS),
    Refused(("socket",),
            "a Unix socket, named or abstract, reaches every process of the network namespace, the test's other "
            "ranks included: a channel the loopback never carries (issue 57's second route averaged DDP over one); "
            "socketpair stays, its two ends are the rank's",
            when=GROUP_UP, where=(((0, "==", socket.AF_UNIX),),), condition="AF_UNIX"),
    Refused(("socket",),
            "every family but Unix, IPv4, IPv6 and netlink's routing protocol (what glibc reads interfaces "
            "and addresses through): a netlink user socket carries messages between any processes of the "
            "network namespace and queues them in kernel memory charged to no cgroup (a fresh-eyes attack "
            "parked optimizer state and averaged DDP there); the other families reach devices, the kernel "
            "or other hosts, none of which a rank needs",
            where=(*(((0, "==", family),) for family in range(socket.AF_NETLINK) if family not in ALLOWED_FAMILIES),
                   ((0, ">", socket.AF_NETLINK),),
                   ((0, "==", socket.AF_NETLINK), (2, "!=", NETLINK_ROUTE))),
            condition="a family other than AF_UNIX, AF_INET, AF_INET6, or AF_NETLINK with NETLINK_ROUTE"),
)


def refused(when: str) -> list[Refused]:
    return [r for r in REFUSED if r.when == when]


def install(when: str) -> None:
    """Load the filter of the calls ``REFUSED`` refuses ``when`` in this process, on every thread it
    has. Raises OSError (the rank then fails to start: a grader failure, never the
    submission's) where libseccomp or the kernel cannot load it."""
    import pyseccomp as seccomp

    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    rules.set_attr(seccomp.Attr.CTL_TSYNC, 1)
    rules.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.ERRNO(errno.EPERM))  # a 32-bit call: every call refused
    for entry in refused(when):
        for call in entry.calls:
            try:
                number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, call)
            except (OSError, ValueError):
                continue  # a call this architecture lacks (or libseccomp does not know) cannot be made
            if number < 0:
                continue
            if not entry.where:
                rules.add_rule(seccomp.ERRNO(entry.error), number)
            for rule in entry.where:
                rules.add_rule(seccomp.ERRNO(entry.error), number, *(_compared(seccomp, *c) for c in rule))
    rules.load()


def _compared(seccomp, argument: int, op: str | tuple[str, int], value: int):
    """One comparison of a rule (``Refused.where``) as libseccomp's ``Arg``."""
    name, mask = op if isinstance(op, tuple) else (op, None)
    how = getattr(seccomp, OPS[name])
    return seccomp.Arg(argument, how, mask, value) if mask is not None else seccomp.Arg(argument, how, value)


@dataclass(frozen=True)
class Guarantee:
    """One row of the manual's table: what a rank may reach, or what is read of it, in each mode
    (``MODES``), and the tests that back it."""

    what: str
    modes: tuple[str, str, str, str]
    backed_by: str


MODES = ("root, ns", "root, no ns", "user, user ns", "user, none")

GUARANTEES: tuple[Guarantee, ...] = (
    Guarantee("what it may call: the kernel refuses every call of the table \"What a rank may call\" "
              "(`policy.REFUSED`), on every thread, from before the submission's first import",
              ("yes", "yes", "yes", "yes"),
              "`test_grading_policy.py` (each call refused in a rank; the hostile routes graded both ways)"),
    Guarantee("its writable storage: its home, TMPDIR, `/dev/shm` and its working copy's overlay, each a tmpfs "
              "of 256 MiB charged to its memory cgroup; nothing on disk",
              ("yes", "no: the run's home, on disk, emptied after each test; the files the ranks' uid holds there "
               "and in the shared folders are read with each rank's memory (`outside.stored_on_disk`)", "yes", "no"),
              "`test_grading_sealed.py::…[storage]`, `…[storage_on_disk]` (graded as such a container: "
              "`GRADING_PRIVATE_STORAGE=0`), `test_grading_witnesses.py::test_averaging_through_files_in_home_fails`"),
    Guarantee("the group's rendezvous: rank 0's TCP store on the loopback, no shared folder",
              ("yes", "yes", "yes", "yes"),
              "every grading (`ranks._rank_main`); `…[storage]` finds no other writable place"),
    Guarantee("memory read as what the kernel charges the rank's own cgroup (every process and task in it), less "
              "its charge once imported; the parts (anonymous, files, kernel, sockets) explain a finding, a second "
              "witness beside it",
              ("yes", "only where `/sys/fs/cgroup` is writable; else `/proc` of the rank's processes, read from any "
               "of their threads", "with a delegated cgroup v2", "no"),
              "`test_grading_rank_cgroups.py`, `…[helper]`, "
              "`test_a_process_whose_main_thread_left_is_read_from_its_threads`"),
    Guarantee("bounds: 2 GiB of memory per rank, 4096 tasks per run, 512 processes per student uid, 16 GiB of "
              "address space and 1 GiB per file per process",
              ("yes", "the per-process ones; a cgroup's where one can be made", "the per-process ones and a cgroup's",
               "per process"),
              "`test_a_rank_over_its_memory_bound_fails_with_the_bound_named`, `test_grading_hostile.py` (700 "
              "processes)"),
    Guarantee("what the submission's code does (C calls, maps, processes, sockets, compiled strings), witnessed by "
              "an audit hook it cannot remove, on its own threads too",
              ("yes", "yes, with file writes", "yes", "yes"),
              "`…[helper]`, `test_grading_witnesses.py`, `test_grading_policy.py` (through a thread pool), "
              "`test_grading_fairness.py` (unused lines hold nothing)"),
    Guarantee("a hold counts as not passed, cap included, until a TA decides",
              ("yes", "yes", "yes", "yes"), "`…[class_attribute]`"),
    Guarantee("the bytes ranks carry, read from their own loopback",
              ("yes", "no (the probe inside the rank decides overlap)", "yes", "no"),
              "`test_grading_traffic.py`, `test_grading_witnesses.py`"),
    Guarantee("a uid of its own; the grader's processes out of reach",
              ("yes", "yes", "no (not dumpable only)", "no"), "`test_grading_hostile.py`"),
    Guarantee("clean-up without recursion that no tree breaks; one submission's leftovers never reach the next",
              ("yes", "yes", "yes", "yes"),
              "`test_a_deep_tree_and_a_link_are_removed_without_recursion_or_following`, "
              "`test_a_submission_that_leaves_a_mess_does_not_change_the_next_grade`"),
)


def calls_table() -> str:
    """The manual's table "What a rank may call", from ``REFUSED``."""
    rows = ["| refused (EPERM unless named) | when | why |", "| --- | --- | --- |"]
    for entry in REFUSED:
        calls = ", ".join(f"`{c}`" for c in entry.calls) + (f" ({entry.condition})" if entry.condition else "")
        if entry.error != errno.EPERM:
            calls += f" ({errno.errorcode[entry.error]})"
        rows.append(f"| {calls} | {entry.when} | {entry.reason} |")
    return "\n".join(rows)


def guarantees_table() -> str:
    """The manual's table "What each mode guarantees", from ``GUARANTEES``."""
    rows = [f"| what a rank can reach or call, and what is read | {' | '.join(MODES)} | backed by |",
            "| --- |" + " --- |" * (len(MODES) + 1)]
    rows += [f"| {g.what} | {' | '.join(g.modes)} | {g.backed_by} |" for g in GUARANTEES]
    return "\n".join(rows)


if __name__ == "__main__":
    print(calls_table(), guarantees_table(), sep="\n\n")
