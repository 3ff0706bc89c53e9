"""One command-line dialect for every script, generated from its settings dataclass.

A settings field becomes a flag when its metadata holds an :class:`Option` (``--model-size``
for ``model_size``), with a :class:`Check` that parses and validates the text where it is
parsed: a bad value ends the script with one line, ``error: argument --flag: ...`` naming the
value and what is allowed, and exit status 2, before any process starts. Checks that span
several flags (a batch that must split over the world size, a device that must exist) are the
settings' ``validate()``, reported the same way. The same words mean the same thing in every
script: ``--world-size``, ``--global-batch`` (sequences per step over all ranks),
``--model-size {choices}``, ``--out`` (the results file) and ``--tag`` (its folder).

Every check also knows values it must refuse (:attr:`Check.bad_values`); the bad-input test
feeds them to every flag of every script, so a new flag is covered when it is added.

Why not tyro (which torchtitan uses to make flags from config dataclasses): tried with tyro
1.0.17, a refused value ends with exit status 2 but prints a box of 5 to 10 lines
("╭─ Value error ─...", the argument's help text, "For full helptext, see ... --help"), with no
setting for one line (``console_outputs=False`` still prints it); ``float`` takes ``nan`` and
``inf`` and a ``tuple[float, ...]`` flag takes no value at all, so every bound would come back
as a constructor spec per type, as long as the checks here; and the bad-input test lists each
flag's check from the parser, which tyro does not expose. Kept: argparse, driven by the fields.
"""

from cs336_systems.cli.checks import (
    MAX_COUNT,
    MAX_MB,
    MAX_RANKS,
    Check,
    Choice,
    ExistingFolder,
    FOLDER_NAME,
    Integer,
    NAME,
    Number,
    OutputFile,
    OutputFolder,
    Word,
)
from cs336_systems.cli.options import (
    Option,
    check_fields,
    choice,
    count,
    fraction,
    nonnegative,
    option,
    positive,
    switch,
)
from cs336_systems.cli.parser import Parser, format_table, in_mb, in_ms, ratio_cell, stops_cleanly
