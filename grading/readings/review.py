"""Held for review: where the grader's witnesses disagree, a TA decides, with both in front of them.

A check that reads a rank from outside (its memory, its loopback bytes) has more than one
witness: the reading itself; the rank's own tensors, counted inside it; whether the rank's memory
fell below what it held once imported; the kernel's whole charge of its cgroup beside the sum
of its parts (bounds.py); the tensors its modules hold once imported; and what the submission's own code
*did* (``witness``: Python's audit hooks, which fire on C calls, memory maps, new processes and
sockets, and code compiled from strings, and which no code can remove once added). A false cap
hits an honest student silently, while a forgery needs deliberate work a TA recognises in the
code; so where the witnesses disagree the check neither passes nor gives: it fails with a reason
that starts with ``HELD``, counts as not passed (its problem's cap included) until a TA looks,
and grade.md, grades.csv and the staff summary list it with both readings and what releasing
it would give (report.py).

What a line of text says is no witness: a line that never runs holds nothing, and a ``#`` in a
string or an import by a computed name hides nothing from a hook that sees the call itself.
"""

from __future__ import annotations

import _thread
import os
import site
import sys
import sysconfig
import threading
from typing import Callable

HELD = "held for review: "
KEY = "witnessed"  # a report's entry the grader fills with what the rank's audit hook streamed
MAX_HITS = 12  # witnessed lines a rank streams at most

# Audit events (https://docs.python.org/3/library/audit_events.html) a rank's own code has no
# ordinary need of in a DDP or FSDP wrapper, each with what a TA looks for.
WATCHED = {
    **dict.fromkeys(("ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.cdata/buffer",
                     "ctypes.call_function", "ctypes.addressof", "ctypes.string_at", "ctypes.create_string_buffer"),
                    "calls into C (ctypes): memory and pages the readings cannot attribute"),
    "mmap.__new__": "maps memory (mmap): state kept in a file's or a shared segment's pages",
    **dict.fromkeys(("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen"),
                    "starts a process: memory kept beside the rank"),
    "socket.__new__": "opens a socket of its own: bytes kept in or sent through buffers of its own",
    "compile": "compiles code from a string (exec/eval/compile)",
}


def held(reason: str, *evidence: str) -> str:
    """A check's reason to hold its problem for review, with the evidence a TA reads."""
    return HELD + reason + "".join(f"; {e}" for e in evidence if e)


def is_held(reason: str) -> bool:
    return reason.startswith(HELD)


def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


# Where a rank's storage is on disk (no user namespace for a tmpfs of its own: sandbox.private_storage),
# a file it writes and drops from the page cache holds what no memory reading sees.
ON_DISK = {"open": "writes a file, which this grader's ranks keep on disk where no memory reading sees it"}
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _writes(args: tuple) -> bool:
    mode, flags = (args + (None, None))[1:3]
    return (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITES)


def witness(send, roots: list[str], on_disk: bool = False) -> Callable[[], None]:
    """Rank side, before any of the submission's code runs: an audit hook that sends
    ``send({"witness": "file:line: what"})`` when the submission's own code does what ``WATCHED``
    names, at most ``MAX_HITS`` lines, each once, from the moment the returned ``arm`` is called
    (the suite calls it at the pause once the submission is imported: what its imports do, a
    ``git`` call for a version string, holds nothing the readings judge, which start there).

    The code that did it: walking out from the call, the standard library's frames are passed
    (``multiprocessing`` or ``subprocess`` called by the rank is the rank's), and so are frames
    of code with no file of its own (``<string>``, or a function whose file name was changed:
    the caller that runs it is named); the first frame left decides. The submission's own file
    is witnessed; a library's or the grader's own use (torch loading a library, a compiler
    starting its workers, the suite's pauses) is theirs, and an import met first (a module's
    first import) is the import's. For ``compile`` only the direct caller counts, whatever it
    compiles (a string or a syntax tree): the import system compiles every module it loads. The
    hook never raises (an honest call goes through whatever happens here), holds the only
    references it uses, and cannot be removed (PEP 578); the flag ``arm`` sets can only be set.
    ``on_disk``: the rank's storage is on disk, and a file it opens for writing is witnessed too,
    whoever's code makes the call for it (the innermost of its own frames names the line).

    A thread the submission started is the submission's: a call on it whose every frame is passed
    (``pool.submit(socket.socket, AF_INET)`` on a ``concurrent.futures`` worker) is witnessed at the
    line that started the thread (``ThreadOwners``); one on a Python thread started around that
    record (the original start function, dug out of the wrapper) is the submission's as well."""
    own = tuple(os.path.realpath(r) + os.sep for r in roots)
    library = _library_prefixes()
    grader = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep  # grading/
    installed = tuple({os.path.realpath(p) + os.sep for p in (*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                                                               sysconfig.get_paths()["platlib"])})
    getframe, realpath, seen, armed = sys._getframe, os.path.realpath, set(), []

    def passed(frame) -> bool:
        if student(frame) is not None:
            return False  # code of the submission's module, whatever file name its code object claims
        name = frame.f_code.co_filename
        if name.startswith("<frozen"):
            return False  # an import: what the imported module does is its own
        if name.startswith("<"):
            return True  # code with no file: whoever runs it is named
        path = realpath(name)
        return path.startswith(library) and "site-packages" not in path and "dist-packages" not in path

    def student(frame) -> str | None:
        """The submission's file the frame's code is in, or None. A code object names its file
        itself (``co_filename``, which ``code.replace`` sets to anything, torch's own file say);
        the module whose globals the frame runs in is where the function was defined, so either
        one in the submission makes the frame the submission's. Code that names no file
        (``<string>``) is named by whoever runs it, as before (``passed``)."""
        if frame.f_code.co_filename.startswith("<"):
            return None
        for name in (frame.f_code.co_filename, frame.f_globals.get("__file__")):
            if not isinstance(name, str) or name.startswith("<"):
                continue
            path = realpath(name)
            root = next((r for r in own if path.startswith(r)), None)
            if root is not None and not path.startswith(grader) and not path.startswith(installed):
                return os.path.relpath(path, root)  # (not the grader, nor this interpreter's .venv in the checkout)
        return None

    watched = {**WATCHED, **(ON_DISK if on_disk else {})}

    def outermost_passed(frame):
        """The first frame the walk out from ``frame`` does not pass; None where it passed them
        all, up to the thread's first (the owner of the thread then decides)."""
        while frame is not None and passed(frame) and frame.f_code is not threads.bottom:
            frame = frame.f_back
        return None if frame is None or frame.f_code is threads.bottom else frame

    def starter(frame) -> str | None:
        frame = outermost_passed(frame)
        if frame is None:
            return threads.owner()  # a thread started from a thread: the first one's owner
        where = student(frame)
        return f"{where}:{frame.f_lineno}" if where else None

    threads = ThreadOwners(starter)

    def hook(event: str, args: tuple) -> None:
        what = watched.get(event)
        if what is None or not armed or len(seen) >= MAX_HITS:
            return
        try:
            frame = getframe(1)
            if event == "open":
                if not _writes(args):
                    return
                while frame is not None and not frame.f_code.co_filename.startswith("<frozen") and student(frame) is None:
                    frame = frame.f_back
            elif event != "compile":
                frame = outermost_passed(frame)
            elif frame is not None and passed(frame) and outermost_passed(frame) is None:
                frame = None  # compiled by the standard library on a thread nobody else's code is on
            if frame is None:
                owner = threads.owner()
                if owner is None:
                    return
                line = f"{owner}: {what} (on a thread started there)"
            else:
                where = student(frame)
                if where is None:
                    return
                line = f"{where}:{frame.f_lineno}: {what}"
            if line not in seen:
                seen.add(line)
                send({"witness": line})
        except BaseException:  # noqa: BLE001 - a witness never changes what the code does
            pass

    sys.addaudithook(hook)
    return lambda: armed.append(True)


class ThreadOwners:
    """Who started each Python thread of the rank: ``starter(frame)`` (the frame that started it)
    gives the submission's ``file:line``, or None for the grader's or a library's. Python 3.11
    raises no audit event when a thread starts, so both ways of starting one (``threading``'s and
    ``_thread``'s own) are wrapped here, in the rank, before the submission is imported; the
    wrapper's frame (``bottom``) is each thread's first, and the thread leaves its record when it
    ends. ``owner()``: this thread's owner; a Python thread without a record was started around
    the wrappers (by code that dug the original out) but known to ``threading`` is the submission's."""

    UNRECORDED = "a thread started around the grader's record"

    def __init__(self, starter: Callable):
        original, owners, get_ident = _thread.start_new_thread, {}, _thread.get_ident

        def start_new_thread(function, args, kwargs=None):
            owner = starter(sys._getframe(1))

            def first(*a, **k):
                owners[get_ident()] = owner
                try:
                    return function(*a, **k)
                finally:
                    owners.pop(get_ident(), None)

            return original(first, args, kwargs or {})

        owners.update(dict.fromkeys(t.ident for t in threading.enumerate()))  # the grader's, started before
        self.owners, self.main = owners, threading.main_thread().ident
        self.bottom = _first_code(start_new_thread)
        _thread.start_new_thread = threading._start_new_thread = start_new_thread

    def owner(self) -> str | None:
        ident = _thread.get_ident()
        if ident in self.owners:
            return self.owners[ident]
        thread = threading._active.get(ident)
        if ident == self.main or thread is None or isinstance(thread, threading._DummyThread):
            return None  # the rank's own thread, or one of torch's or gloo's calling into Python
        return self.UNRECORDED


def _first_code(wrapper):
    """The code of the function ``wrapper`` defines inside itself (each thread's first frame)."""
    return next(c for c in wrapper.__code__.co_consts if hasattr(c, "co_name") and c.co_name == "first")


def take(buffer: bytearray, frame, found: list[str]) -> bool:
    """Grader side: consume a witness frame at the head of ``buffer`` into ``found``; whether one was."""
    from grading.isolation import wire

    message = frame(buffer)
    if not message:
        return False
    try:
        decoded = wire.decode(message)
    except wire.WireError:
        return False
    if not (isinstance(decoded, dict) and set(decoded) == {"witness"} and isinstance(decoded["witness"], str)):
        return False
    del buffer[:8 + len(message)]
    if len(found) < MAX_HITS:
        found.append(decoded["witness"][:300])
    return True


def witnessed(reports: list[dict]) -> str:
    """What the ranks' own code did that can make an outside reading lie, as a hold's evidence;
    "" when it did none of it."""
    found = [f"rank {r}: {line}" for r, report in enumerate(reports) for line in (report.get(KEY) or [])]
    return f"what its own code did as it ran: {'; '.join(found[:MAX_HITS])}" if found else ""
