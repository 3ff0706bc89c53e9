"""Field metadata that turns a settings dataclass field into a flag, and the short forms to write it."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

from cs336_systems.cli.checks import MAX_COUNT, Check, Choice, Integer, Number

@dataclass(frozen=True)
class Option:
    """Field metadata that makes a settings field a flag."""

    help: str
    check: Check | None = None  # None: a switch (store_true)
    many: bool = False  # one or more values (nargs="+")
    flag: str | None = None  # default: "--" + the field name with '-' for '_'


def option(help: str, check: Check | None = None, many: bool = False, flag: str | None = None) -> dict:
    """``field(metadata=option(...))``."""
    return {"cli": Option(help, check, many, flag)}


def count(help: str, minimum: int = 1, maximum: int = MAX_COUNT, many: bool = False) -> dict:
    return option(help, Integer(minimum, maximum), many)


def positive(help: str, high: float = math.inf, many: bool = False) -> dict:
    return option(help, Number(0.0, high, low_open=True), many)


def nonnegative(help: str, high: float = math.inf) -> dict:
    return option(help, Number(0.0, high, low_open=False))


def fraction(help: str) -> dict:
    return option(help, Number(0.0, 1.0, low_open=True))


def choice(help: str, values: Iterable[str], many: bool = False) -> dict:
    return option(help, Choice(tuple(values)), many)


def switch(help: str) -> dict:
    return option(help)


def check_fields(settings: Any) -> None:
    """Hold a settings object built in code to its flags' checks: ValueError naming the first field
    whose value the check refuses (parsed settings passed them already). ``None`` means unset."""
    for f in dataclasses.fields(settings):
        opt = f.metadata.get("cli")
        value = getattr(settings, f.name)
        if opt is None or opt.check is None or value is None:
            continue
        for item in (value if opt.many else (value,)):
            try:
                opt.check.parse(str(item))
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{f.name} {e}") from None
