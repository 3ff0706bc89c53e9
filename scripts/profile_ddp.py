"""Problem 5b: profiler timelines showing that per-parameter DDP overlaps all-reduce with backward.

Profiles a few training steps of naive and per-parameter DDP in one process group and writes
profile.json (default writeup/results/<tag>/profile/profile.json): per variant the timelines
of the profiled steps as intervals (phases, backward compute, all-reduces), the overlap
fraction (share of all-reduce time inside backward), all-reduce and backward time and the
number of all-reduce events, with the setting and environment. Beside it, rank 0's Chrome
traces trace_naive.json and trace_per-parameter.json (.json.gz when large; open them in
https://ui.perfetto.dev or chrome://tracing). `make writeup` draws the timelines from
profile.json.

Three ways to run it:

    # plain command: spawns the ranks on this machine (gloo on CPU by default)
    python scripts/profile_ddp.py --model-size cpu-small --world-size 2

    # under torchrun: one process per rank (NCCL kernels appear on the GPU lanes)
    torchrun --nproc-per-node 2 scripts/profile_ddp.py --device cuda --model-size xl

    # on a SLURM cluster through submitit
    python scripts/submit_slurm.py --gpus-per-node 2 -- scripts/profile_ddp.py --device cuda --model-size xl
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from cs336_systems import cli
from cs336_systems.bench.profile import ProfileRecord, ProfileSetting, nsys_command, profile_into
from cs336_systems.bench.profile.run import move_traces
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import save_results



def format_records(records: list[ProfileRecord]) -> str:
    rows = [[r.variant, f"{r.overlap_fraction:.1%}", f"{1e3 * r.communication_s:.1f}", f"{1e3 * r.backward_s:.1f}",
             r.n_comm_events] for r in records]
    return cli.format_table(["variant", "overlap", "all-reduce ms", "backward ms", "events"], rows)


def build_parser() -> cli.Parser:
    """The flags, generated from ProfileSetting, plus --out (profile.json; traces beside it) and --tag."""
    return cli.Parser(ProfileSetting, __doc__, results_kind=ProfileRecord.KIND)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The traces wait in a folder of their own until save_results says where profile.json went: a
    # refused run leaves none, and one filed as not quiet must not overwrite the quiet run's traces.
    with tempfile.TemporaryDirectory(prefix=".traces-", dir=out.parent) as traces:
        run = profile_into(setting, Path(traces))
        if run is None:
            return 0  # a rank other than 0 under torchrun/SLURM: rank 0 writes everything
        environment = collect_environment(setting.backend_name, run.world_size, setting.device, run.shared_gpu)
        out = save_results(out, ProfileRecord.KIND, setting, run.records, environment, run.notes)
        move_traces(run.records, Path(traces), out.parent)
    print(format_records(run.records))
    print(f"wrote {out} and the traces beside it")
    print("with Nsight Systems on a GPU machine, record the same run with:")
    print(f"  {nsys_command(setting, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
