"""The all-reduce benchmark (problem distributed_communication_single_node).

Time of one ``dist.all_reduce`` of a float32 payload by backend, world size and payload, with
nccl-tests' statistics (median and spread of the slowest rank's time, algbw, busbw) and a
check of the reduced values.

* setting.py  AllReduceSetting (the run and its CLI flags, checked before anything starts), GridPoint
* record.py   AllReduceRecord (one point, as stored in ``allreduce.json``) and its statistics
* plan.py     the time budget and the memory guard (what fits)
* timing.py   the fill pattern, its check, and timing one payload on one rank (time_payload)
* group.py    one group of ranks running every payload, rank 0 deciding for all
* run.py      the driver: one group per (backend, world size), spawned or under a launcher
"""

from cs336_systems.bench.allreduce.group import GroupLimits, GroupResult, benchmark_group_rank
from cs336_systems.bench.allreduce.plan import memory_skip_reason, plan_iterations
from cs336_systems.bench.allreduce.record import (
    AllReduceRecord,
    bus_bandwidth_factor,
    measured_record,
    skipped_record,
    summarize_times,
)
from cs336_systems.bench.allreduce.run import console_table, is_writer_process, run_allreduce_benchmark
from cs336_systems.bench.allreduce.setting import AllReduceSetting, GridPoint, payload_bytes
from cs336_systems.bench.allreduce.timing import fill_pattern, matches_reduced_pattern, time_payload
