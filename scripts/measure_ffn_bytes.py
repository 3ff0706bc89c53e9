"""The 2026 handout's section 8, measured: bytes each rank sends in the FFN under DP, FSDP and TP.

Spawns gloo ranks on this machine (world sizes 2 and 4 by default); each runs the FFN of equations
(20)–(30) under DP, FSDP and TP through real collectives, in FP16, and counts the bytes it writes
to its sockets in the forward and the backward pass. Prints every rank's bytes beside the handout's
communication term and writes writeup/results/<machine tag>/ffn_bytes.json (or --out). The
measurement lives in cs336_systems/capacity/ffn_check.py and ffn_bytes.py.

    python scripts/measure_ffn_bytes.py                          # world sizes 2 and 4, B = 512, D = 256, D_FF = 512
    python scripts/measure_ffn_bytes.py --world-sizes 2 4 8 --d-ff 1024
"""

from __future__ import annotations

import sys

from cs336_systems import cli
from cs336_systems.capacity.ffn_bytes import FfnBytesRecord, FfnBytesSetting, measure_ffn_bytes
from cs336_systems.results.environment import collect_environment
from cs336_systems.results.files import save_results


def build_parser() -> cli.Parser:
    """The flags, generated from FfnBytesSetting, plus --out and --tag."""
    return cli.Parser(FfnBytesSetting, __doc__, results_kind=FfnBytesRecord.KIND)


def report(records: list[FfnBytesRecord]) -> str:
    rows = [[r.strategy, r.world_size, " ".join(map(str, r.forward_bytes)), f"{r.expected_forward_bytes:.0f}",
             " ".join(map(str, r.backward_bytes)), f"{r.expected_backward_bytes:.0f}", f"{r.max_gradient_error:.1e}"]
            for r in records]
    return cli.format_table(["strategy", "ranks", "forward bytes", "term", "backward bytes", "term", "grad error"], rows)


@cli.stops_cleanly
def main(argv: list[str] | None = None) -> int:
    setting, out = build_parser().parse_with_output(argv)
    records = measure_ffn_bytes(setting)
    environment = collect_environment("gloo", max(setting.world_sizes), "cpu")
    save_results(out, FfnBytesRecord.KIND, setting, records, environment)
    print(report(records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
