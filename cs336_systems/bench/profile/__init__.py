"""Profiler timelines of DDP steps (problem 5b): where the all-reduces fall relative to backward.

* setting.py   ProfileSetting: the workload, the variants, warm-up and profiled steps; the nsys command
* run.py       the profiled run on every rank; rank 0 saves and reads its Chrome traces
* trace.py     a Chrome trace -> step timelines, the communication lane chosen by backend
* timeline.py  StepTimeline (intervals of one step) and interval arithmetic
* record.py    ProfileRecord, one per variant in ``profile/profile.json``, timelines included
"""

from cs336_systems.bench.profile.record import ProfileRecord
from cs336_systems.bench.profile.run import ProfileRun, profile_into
from cs336_systems.bench.profile.setting import PROFILED_VARIANTS, ProfileSetting, nsys_command
from cs336_systems.bench.profile.timeline import (
    PHASES,
    Interval,
    StepTimeline,
    length_inside,
    merge_intervals,
    total_length,
)
from cs336_systems.bench.profile.trace import (
    AUTOGRAD_NODE_PREFIX,
    BACKENDS,
    ENQUEUE_ALL_REDUCE,
    GLOO_ALL_REDUCE,
    STEP_RANGE,
    extract_step_timelines,
    load_trace,
    save_trace,
)
