"""What is imported before a rank's baseline: the environment's libraries in the fork server,
the submission's declared packages in each rank.

Every rank is forked from the fork server, so what the server has imported a rank has without
importing it again. The server imports torch and the suite's rank-side code; the harness names
here (``GRADING_PRELOAD``, from intake: packages.libraries) the libraries of the grader's own
environment, the course's, that the submission's files import (matplotlib, einops, ...), and
``torch.compile`` where a file compiles a function (its first use imports about 600 modules:
2.5 s per rank). A library a rank imports lazily after its baseline would otherwise be read as
what it stores (``rich``, imported inside ``add_param_group`` for one print, held 8 points of a
real student; a lazy import's copies on write of pages shared with the server, 6.9 MB of charge
to one rank). A library that fails to import is left to the ranks, which import it as before
and report what happens.

**No process that a rank inherits from ever runs any of the submission** (issue 57). The
packages a submission declares and the grader installed for it (packages.py: its layer) are the
submission's code: one that maps shared memory at import and is imported in the server hands
every rank the same pages, a channel between them and memory charged to no rank (96 MiB that
weak code kept its state and weights in, and averaged its gradients through, for 35/35). So the
server never puts the layer on its path, and imports nothing from it; each rank imports the
declared packages its submission's files import (``GRADING_DECLARED``) itself
(``import_declared``), after its group is up and before its first pause, when the submission's
own code may run: what they make at import is charged to that rank's baseline, as its own
imports are, and shared with no other rank.
"""

from __future__ import annotations

import os
import sys

DECLARED_ENV = "GRADING_DECLARED"  # the declared packages' modules the submission's files import, for the ranks
PRELOAD_ENV = "GRADING_PRELOAD"  # the environment's libraries they import, for the fork server


def _import(name: str) -> None:
    try:
        if name == "torch.compile":
            import torch

            torch.compile(lambda x: x)  # imports what compiling needs; compiles nothing
        else:
            __import__(name)
    except BaseException:  # noqa: BLE001 - the submission imports it itself and says what fails
        pass


def import_declared() -> None:
    """Rank side, once the submission's code may run (ranks._rank_main): import the modules of its
    declared packages that its files import, from its layer (on the rank's path by then)."""
    for name in filter(None, os.environ.get(DECLARED_ENV, "").split(",")):
        _import(name)


if os.environ.get("GRADING_RANK_SERVER") and sys.argv[:1] == ["-c"]:
    _before = dict(os.environ)
    for _name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        _import(_name)
    for _key in set(os.environ) - set(_before):  # a cache folder an import chose: the ranks choose their own
        del os.environ[_key]
