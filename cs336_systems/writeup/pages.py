"""The writeup's pages, in reading order: the one list to extend.

A page is a function ``(RenderContext) -> Page``: it reads ``ctx.inputs`` (every machine's
results files, see :mod:`cs336_systems.writeup.load`), writes its figures to
``ctx.figure_path(name)``, records what was not measured with ``coverage.note_gaps``, and
returns its details page and its answers, both rendered from templates
(:mod:`cs336_systems.writeup.templating`). The machines page comes last: it lists the gaps the
others recorded.
"""

from __future__ import annotations

from cs336_systems.results.environment import OTHERS_LIMIT, OTHERS_LIMIT_BY_KIND
from cs336_systems.results.host import CALIBRATION_LIMIT, SPREAD_LIMIT, STEAL_LIMIT
from cs336_systems.writeup import fmt, templating
from cs336_systems.writeup.ablation_section import ablation_page
from cs336_systems.writeup.allreduce_section import allreduce_page
from cs336_systems.writeup.answers_section import answers_page
from cs336_systems.writeup.communication_accounting_section import communication_accounting_page
from cs336_systems.writeup.context import Page, PageFn, RenderContext
from cs336_systems.writeup.ddp_sections import ddp_step_page
from cs336_systems.writeup.family_section import family_page
from cs336_systems.writeup.fsdp_section import fsdp_page
from cs336_systems.writeup.lightning_claims_section import lightning_claims_page
from cs336_systems.writeup.load import MachineResults
from cs336_systems.writeup.naive_ddp_section import naive_ddp_page
from cs336_systems.writeup.overhead_section import overhead_page
from cs336_systems.writeup.parallelism_section import parallelism_page
from cs336_systems.writeup.problems_section import grading_page
from cs336_systems.writeup.profile_section import profile_page
from cs336_systems.writeup.sharding_section import sharding_page


def host_limits() -> dict:
    """The limits a run is held to (results.environment, results.host), for the page that states them."""
    return dict(others=OTHERS_LIMIT, profile=OTHERS_LIMIT_BY_KIND["profile"], steal=STEAL_LIMIT,
                calibration=CALIBRATION_LIMIT, spread=SPREAD_LIMIT)


def doctor_page(ctx: RenderContext) -> Page:
    """Beyond the handout: what ``make doctor`` checks (a details page only: a diagnosis, not a measurement)."""
    return Page("doctor", templating.render("details/doctor.md.j2"))


def _machine_hardware(machine: MachineResults) -> str:
    envs = [f.environment for f in machine.files.values()]
    gpu = next((e for e in envs if e.gpu_name), None)
    cpu = envs[0] if envs else None
    parts = [fmt.hardware(gpu, "cuda")] if gpu else []
    parts += [fmt.hardware(cpu, "cpu")] if cpu else []
    return "; ".join(parts) or "unknown"


def _load_summary(files) -> str:
    """Which files recorded the machine's load and the host, and any whose timings they disqualify."""
    recorded = [f for f in files if f.environment.load is not None]
    loaded = [f"`{f.path.name if f.path else f.name}`" for f in recorded if fmt.not_evidence(f.environment)]
    noisy = [f"`{f.path.name if f.path else f.name}`" for f in files if f.environment.host and not f.environment.host.quiet]
    text = (f"{len(recorded)} of {len(files)} files recorded the load, "
            f"{sum(f.environment.host is not None for f in files)} the host")
    return text + (f"; over the cores in {', '.join(loaded)}: timings not evidence" if loaded else "") + (
        f"; not quiet: {', '.join(noisy)}" if noisy else "")


def machines_page(ctx: RenderContext) -> Page:
    """The machines, the units, unreadable files, and every gap the other pages recorded, once per setting."""
    # The commit each machine's results record (a results file names the checkout it ran from).
    rows = [[f"`{m.tag}`", _machine_hardware(m), ", ".join(f"`{name}.json`" for name in m.files) or "–",
             "; ".join(sorted({fmt.commit(f.environment) for f in m.files.values()})) or "–",
             _load_summary(list(m.files.values()))]
            for m in ctx.inputs.machines]
    unreadable = [(m.tag, name, why) for m in ctx.inputs.machines for name, why in m.unreadable.items()]
    settings: dict[str, list] = {}
    for gap in ctx.gaps:
        settings.setdefault(gap.setting, []).append(gap)
    files = [f for m in ctx.inputs.machines for f in m.files.values()]
    markdown = templating.render(
        "details/machines.md.j2", results=ctx.results_label, limits=host_limits(),
        unrecorded=sum(f.environment.load is None for f in files), uncounted=sum(
            f.environment.load is not None and f.environment.load.others is None for f in files),
        no_host=sum(f.environment.host is None for f in files), n_files=len(files),
        machines=fmt.table(["machine tag", "hardware", "results files", "commits recorded", "load and host during the run"], rows,
                           align="lllll") if rows else None,
        unreadable=unreadable, gaps=settings)
    return Page("machines", markdown)


PAGES: list[PageFn] = [
    grading_page,
    answers_page,
    allreduce_page,
    naive_ddp_page,
    ddp_step_page,
    profile_page,
    overhead_page,
    ablation_page,
    family_page,
    communication_accounting_page,
    sharding_page,
    fsdp_page,
    parallelism_page,
    lightning_claims_page,
    doctor_page,
    machines_page,
]
