"""Problem 6b: the bucketed-DDP overhead model, derived, fitted to our all-reduce runs, and checked.

The derivation is prose and algebra (no numbers); everything after it is computed from the
``allreduce*.json`` fits and the ``ddp_step*.json`` bucket sweep of the same machine.
"""

from __future__ import annotations

from cs336_systems.writeup import fmt
from cs336_systems.writeup.allreduce_analysis import CommGroup, LinkFit, comm_groups, fit_group
from cs336_systems.bench.allreduce.record import AllReduceRecord
from cs336_systems.bench.step.record import StepRecord
from cs336_systems.bench.step.variants import COMPUTE_ONLY, TORCH_DDP
from cs336_systems.writeup.context import RenderContext, Section
from cs336_systems.writeup.coverage import CPU, GPU, not_measured_notes
from cs336_systems.writeup.ddp_analysis import (
    FLOAT32_BYTES,
    OverheadPrediction,
    bucket_sweep,
    by_variant,
    largest_parameter_bytes,
    predict_overhead,
    step_runs,
)
from cs336_systems.writeup.ddp_figures import overhead_model_figure
from cs336_systems.writeup.load import MachineResults, ResultsFile
from cs336_systems.writeup.step_tables import ddp_setting_line, step_not_measured

DERIVATION = r"""### Derivation

Let $s$ be the bytes of gradient all-reduced per step, split into $n_b$ buckets of $s/n_b$ bytes
each. Model one all-reduce of $b$ bytes as taking $o + b/w$: a fixed cost $o$ per call, plus the
bytes moved at bandwidth $w$. Calls share one communication channel and run one at a time, so a
bucket that becomes ready while an earlier call is still running waits for it. Finally, assume
backward produces one bucket's gradients in exactly the time the channel needs to move them,

$$
c = \frac{s}{w\,n_b},
$$

so bucket $k$ ($k = 1, \dots, n_b$) is ready at $r_k = k\,c$, and backward ends when the last one
is, at $r_{n_b} = n_b\,c = s/w$.

Call $f_k$ the time at which bucket $k$'s all-reduce finishes. It starts once the bucket is ready
and the channel is free, and then takes $o + c$:

$$
f_k = \max(r_k,\, f_{k-1}) + o + c, \qquad f_0 = 0 .
$$

We show $f_k = (k+1)\,c + k\,o$. For $k = 1$ the channel is free, so $f_1 = c + o + c$. If the
formula holds for $k$, bucket $k+1$ is ready at $(k+1)\,c \le f_k$ (as $o \ge 0$): it waits for the
channel, and $f_{k+1} = f_k + o + c = (k+2)\,c + (k+1)\,o$. The channel therefore runs behind
backward by the per-call costs accumulated so far, and the last bucket finishes at

$$
f_{n_b} = n_b \cdot \frac{s}{w\,n_b} + n_b\,o + \frac{s}{w\,n_b} .
$$

Backward ended at $s/w$, so the overhead left exposed after backward is

$$
T(n_b) = f_{n_b} - \frac{s}{w} = o\,n_b + \frac{s}{w\,n_b} .
$$

The first term grows with the number of buckets: every call pays $o$ and none of it gets hidden.
The second, the transfer of the last bucket, which cannot start before backward ends, shrinks
with it. One bucket ($n_b = 1$) gives $o + s/w$, one flat all-reduce after backward.

Treating $n_b$ as a real number, the overhead is smallest where its derivative vanishes,

$$
\frac{dT}{dn_b} = o - \frac{s}{w\,n_b^2} = 0
\quad\Longrightarrow\quad
n_b^{\ast} = \sqrt{\frac{s}{w\,o}} ,
$$

a minimum since $d^2T/dn_b^2 = 2s/(w\,n_b^3) > 0$. The matching bucket size and overhead are

$$
b^{\ast} = \frac{s}{n_b^{\ast}} = \sqrt{s\,w\,o} ,
\qquad
T(n_b^{\ast}) = o\sqrt{\frac{s}{w\,o}} + \frac{s}{w}\sqrt{\frac{w\,o}{s}} = 2\sqrt{\frac{s\,o}{w}} ,
$$

where the two terms are equal. Two limits bound the choice. A parameter is never split between
buckets, so no bucket is smaller than the largest parameter, $p_{\max}$ bytes; and one bucket with
all $s$ bytes is the largest possible. Written in the bucket size $b = s/n_b$, the overhead
$T = o\,s/b + b/w$ is convex in $b$, so the best feasible size is the clamped one:

$$
b_{\mathrm{opt}} = \min\!\bigl(\max\bigl(\sqrt{s\,w\,o},\; p_{\max}\bigr),\; s\bigr) .
$$"""


def _fit_table(groups: dict[CommGroup, list[AllReduceRecord]], fits: dict[CommGroup, LinkFit | str]) -> str:
    rows = []
    for group, records in groups.items():
        fit = fits[group]
        sizes = ", ".join(fmt.size_mb(r.payload_mb) for r in records)
        if isinstance(fit, str):
            rows.append([group.backend, group.device_type, group.world_size, sizes, "–", "–", "–",
                         f"no fit: {fit}"])
            continue
        largest = records[-1]
        rows.append([group.backend, "gloo ranks sharing one GPU" if group.shared_gpu else group.device_type,
                     group.world_size, sizes, fmt.us(fit.o_s), fmt.gbps(fit.w_bytes_per_s), fmt.sig(fit.r2, 4),
                     f"{fmt.sig(largest.algbw_gbps)} at {fmt.size_mb(largest.payload_mb)} MB"])
    return fmt.table(["backend", "device", "ranks", "payloads fitted (MB)", "o (µs)", "w (GB/s)", "R²",
                      "measured algbw at the largest payload (GB/s)"], rows, align="llrlrrrl")


def _machine_fits(machine: MachineResults) -> dict[CommGroup, LinkFit | str]:
    fits: dict[CommGroup, LinkFit | str] = {}
    for results in machine.runs(AllReduceRecord.KIND):
        for group, records in comm_groups(results.records).items():
            fits.setdefault(group, fit_group(records))
    return fits


def _fit_part(ctx: RenderContext) -> list[str]:
    out = ["### Fitting $o$ and $w$ to the all-reduce benchmark", "",
           "Least squares on median time $= o + \\text{bytes}/w$ over the measured payloads of each backend and "
           "world size, each residual taken relative to its measured time: the payloads span decades, and with "
           "plain residuals the largest payload's run-to-run noise would swamp a per-call cost of about a "
           "millisecond (`cs336_systems/ddp/overhead_model.py`). $w$ is bytes of payload per second of one all-reduce "
           "(like algbw, not busbw)."]
    for machine, results in ctx.inputs.runs(AllReduceRecord.KIND):
        groups = comm_groups(results.records)
        fits = {g: fit_group(rs) for g, rs in groups.items()}
        out += ["", fmt.run_heading(machine, results).replace("###", "####"), "",
                fmt.setting_line(results.environment, results.source), "", _fit_table(groups, fits) if groups else
                "No measured payloads to fit."]
    return out


def _prediction_table(p: OverheadPrediction, torch_ddp: StepRecord | None) -> str:
    rows = [[r.variant, fmt.size_mb(r.bucket_size_mb), r.n_buckets, fmt.ms(t),
             fmt.ms(r.exposed_overhead_s), fmt.ratio(r.exposed_overhead_s / t)] for r, t in p.rows]
    if torch_ddp is not None and torch_ddp.n_buckets:
        t = p.predict(torch_ddp.n_buckets)
        rows.append([torch_ddp.variant, "torch default", torch_ddp.n_buckets, fmt.ms(t),
                     fmt.ms(torch_ddp.exposed_overhead_s), fmt.ratio(torch_ddp.exposed_overhead_s / t)])
    return fmt.table(["variant", "bucket cap (MB)", "buckets n_b (measured)", "model T(n_b) (ms)",
                      "measured exposed overhead (ms)", "measured / model"], rows)


# Backward's matmuls cost about twice forward's, so backward is usually the larger part of a step: a
# compute-only step at least this many times s/w points to a backward slower than the channel.
SLOWER_BACKWARD_STEP_RATIO = 2.0


def _backward_pace(step_over_transfer: float, ratios: list[float]) -> str:
    """What the compute-only step says about the model's "backward as fast as the channel" assumption."""
    if step_over_transfer >= SLOWER_BACKWARD_STEP_RATIO:
        text = ("If backward is most of that step, it is slower than the channel: buckets find the channel idle, "
                "and the queued $o\\,n_b$ term overstates that part of the cost")
        if min(ratios) > 1:
            return text + "; every measured point is nonetheless above the model, so the other effects listed " \
                          "here outweigh it."
        return text + "."
    if step_over_transfer < 1:
        return ("Backward, shorter than that whole step, is faster than the channel: the queue grows faster than "
                "the model's, and the model understates that part of the cost.")
    return "From the step time alone it cannot be told whether backward is slower or faster than the channel."


def _discussion(p: OverheadPrediction, results: ResultsFile) -> str:
    variants = by_variant(results.records)
    ratios = [r.exposed_overhead_s / t for r, t in p.rows]
    best_measured = min((r for r, _ in p.rows), key=lambda r: r.exposed_overhead_s)
    best_model = min(p.rows, key=lambda rt: rt[1])[0]
    backward_s = p.s_bytes / p.fit.w_bytes_per_s
    sentences = [
        f"Across the sweep the measured exposed overhead is {fmt.ratio(min(ratios))} to {fmt.ratio(max(ratios))} "
        "the model's prediction.",
        f"Among the sizes tried, the model ranks {fmt.size_mb(best_model.bucket_size_mb)} MB best and the "
        f"measurement {fmt.size_mb(best_measured.bucket_size_mb)} MB "
        f"({fmt.ms(best_measured.exposed_overhead_s)} ms exposed).",
    ]
    flat = variants.get("flat")
    if flat and flat.median_sync_s:
        one_call = p.fit.o_s + backward_s
        sentences.append(
            f"The fit predicts one all-reduce of all {fmt.mb(p.s_bytes)} MB at $o + s/w$ = {fmt.ms(one_call)} ms; "
            f"flat DDP's measured all-reduce phase takes {fmt.ms(flat.median_sync_s)} ms "
            f"({fmt.ratio(flat.median_sync_s / one_call)} the prediction from all-reduces timed on their own)."
        )
    floor = variants.get(COMPUTE_ONLY)
    reasons = [
        "What is measured is the whole step's slowdown against the compute-only step: it also counts any slowing "
        "of forward, backward and the optimizer by communication running beside them, where the model counts only "
        "the time after backward."
    ]
    if floor:
        compute = floor.median_step_s
        reasons.append(
            f"The model takes backward to last $s/w$ = {fmt.ms(backward_s)} ms, producing gradients exactly as fast "
            "as they are sent; the whole compute-only step (forward, backward, optimizer) here takes "
            f"{fmt.ms(compute)} ms, {fmt.ratio(compute / backward_s)} that. "
            + _backward_pace(compute / backward_s, ratios)
        )
    env = results.environment
    if env.device_type == "cpu" and env.cpu_count:
        reasons.append(
            f"On this CPU machine the {env.world_size} ranks and gloo's communication threads share {env.cpu_count} "
            "logical cores, so an all-reduce running during backward takes cores from it: communication and compute "
            "compete instead of overlapping for free."
        )
    reasons.append(
        "The model also leaves out copying gradients into each bucket's buffer and back (a pass over all $s$ "
        "bytes per step, whatever $n_b$), the per-parameter hook work, and the noise left in the measured "
        "overhead (a median of per-round differences, step minus compute-only step: see its 95% interval)."
    )
    return " ".join(sentences) + "\n\n" + "\n".join(f"- {r}" for r in reasons)


def _run_fit(machine: MachineResults, results: ResultsFile) -> LinkFit | str | None:
    """The machine's fit for the run's backend, device, world size and GPU sharing (None: not measured)."""
    env = results.environment
    for group, fit in _machine_fits(machine).items():
        if (group.backend, group.device_type, group.world_size, group.shared_gpu) == (
                env.backend, env.device_type, env.world_size, env.shared_gpu):
            return fit
    return None


def _prediction_part(ctx: RenderContext, machine: MachineResults, results: ResultsFile) -> tuple[list[str], list]:
    env, setting = results.environment, results.setting
    backend, device, world_size = env.backend, env.device_type, env.world_size
    out = ["", fmt.run_heading(machine, results).replace("###", "####"), "", ddp_setting_line(results)]
    if world_size == 1:
        return out + ["", "One rank communicates nothing: there is no overhead to model in this run."], []
    fit = _run_fit(machine, results)
    if fit is None:
        command = GPU.command if device == "cuda" else CPU.command
        return out + ["", f"The all-reduce benchmark on `{machine.tag}` has no {backend} line with {world_size} "
                          f"ranks on {device}: **not measured here**; `{command}` fills it."], []
    if isinstance(fit, str):
        return out + ["", f"No fit for {backend} with {world_size} ranks: {fit}."], []
    n_parameters = results.notes.get("n_parameters")
    sweep = bucket_sweep(results.records)
    if not n_parameters or not sweep:
        return out + ["", "This run lacks the parameter count or a bucket sweep; nothing to predict."], []
    model_size = setting.get("model_size", "")
    p_max = largest_parameter_bytes(model_size, setting.get("context_length"))
    prediction = predict_overhead(n_parameters, p_max, fit, sweep)
    if isinstance(prediction, str):
        return out + ["", f"No prediction: {prediction}."], []
    p = prediction
    torch_ddp = by_variant(results.records).get(TORCH_DDP)
    out += ["",
            f"- $s$ = {FLOAT32_BYTES} bytes × {n_parameters} parameters = {fmt.mb(p.s_bytes)} MB; "
            + (f"$p_{{\\max}}$ = {fmt.mb(p_max)} MB (largest parameter of model `{model_size}`)."
               if p_max else "largest parameter unknown (model size not in `cs336_basics.model`)."),
            f"- fit for {backend}, {world_size} ranks on {device}: $o$ = {fmt.us(fit.o_s)} µs, $w$ = "
            f"{fmt.gbps(fit.w_bytes_per_s)} GB/s ($R^2$ = {fmt.sig(fit.r2, 4)}).",
            f"- $n_b^\\ast = \\sqrt{{s/(w\\,o)}}$ = {fmt.sig(p.n_b_opt)}; "
            f"$\\sqrt{{s\\,w\\,o}}$ = {fmt.mb(p.b_unconstrained_bytes)} MB; clamped to $[p_{{\\max}}, s]$: "
            f"$b_{{\\mathrm{{opt}}}}$ = **{fmt.mb(p.b_opt_bytes)} MB**, predicted exposed overhead "
            f"{fmt.ms(p.t_opt_s)} ms (unclamped minimum $2\\sqrt{{s\\,o/w}}$ = "
            f"{fmt.ms(p.t_unconstrained_s)} ms).",
            "", _prediction_table(p, torch_ddp)]
    path = overhead_model_figure(p, torch_ddp, f"overhead model vs bucket sweep on {machine.tag}",
                                 ctx.figure_path(f"{machine.tag}_{results.name}_overhead_model.png"))
    out += ["", ctx.image(path, f"overhead model against the measured bucket sweep on {machine.tag}"), "",
            _discussion(p, results)]
    return out, [path]


def overhead_model_section(ctx: RenderContext) -> Section:
    out = ["## ddp_bucketed_benchmarking (b): a model of the overhead, and the best bucket size", "", DERIVATION, ""]
    out += _fit_part(ctx)
    out += ["", "### Predicted against measured",
            "", "For each DDP step run, the fit of the same backend and world size on the same machine, "
                "$s$ from the run's parameter count, $n_b$ from the buckets each bucketed variant actually built."]
    figures = []
    for machine, results in step_runs(ctx.inputs):
        lines, figs = _prediction_part(ctx, machine, results)
        out += lines
        figures += figs
    notes = [not_measured_notes(ctx.inputs, AllReduceRecord.KIND, "Fit of $o$ and $w$ (all-reduce benchmark)"),
             step_not_measured(ctx, "Bucket sweep to compare with (DDP step benchmark)")]
    notes = [n for n in notes if n]
    if notes:
        out += ["", "### Not measured here", "", *notes]
    return Section("\n".join(out), figures)
