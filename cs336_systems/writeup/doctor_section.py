"""Beyond the handout: what ``make doctor`` checks (a details page only: a diagnosis, not a measurement)."""

from __future__ import annotations

from cs336_systems.writeup import templating
from cs336_systems.writeup.context import Page, RenderContext


def doctor_page(ctx: RenderContext) -> Page:
    return Page("doctor", templating.render("details/doctor.md.j2"))
