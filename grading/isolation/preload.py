"""The fork server's second act: import, once per grading, the libraries the submission imports.

Every rank is forked from the fork server, so what the server has imported a rank has without
importing it again. The server imports torch and the suite's rank-side code; the harness names
here (``GRADING_PRELOAD``, from intake: packages.libraries) the libraries of the grader's own
environment that the submission's files import (matplotlib, einops, ...), and ``torch.compile``
where a file compiles a function (its first use imports about 600 modules: 2.5 s per rank).
They are imported from the environment, and from the packages installed for the submission
(its declared ones, packages.py), never from its own folders, after the server has confined
itself (rank_server.py); none of the submission's code runs here. A library a rank imports
lazily after its baseline pause would otherwise be read as what it stores (``rich``, imported
inside ``add_param_group`` for one print, held 8 points of a real student). A library that fails to import is left to the ranks, which import
it as before and report what happens.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("GRADING_RANK_SERVER") and sys.argv[:1] == ["-c"]:
    _before = dict(os.environ)
    if os.environ.get("GRADING_SUBMISSION_PACKAGES"):  # what was installed for it (packages.py): libraries too
        sys.path.append(os.environ["GRADING_SUBMISSION_PACKAGES"])
    for _name in filter(None, os.environ.get("GRADING_PRELOAD", "").split(",")):
        try:
            if _name == "torch.compile":
                import torch

                torch.compile(lambda x: x)  # imports what compiling needs; compiles nothing
            else:
                __import__(_name)
        except BaseException:  # noqa: BLE001 - the ranks import it themselves and say what fails
            pass
    for _key in set(os.environ) - set(_before):  # a cache folder an import chose: the ranks choose their own
        del os.environ[_key]
