"""The FSDP step benchmark: DDP, ZeRO-1, our FSDP and torch's FSDP side by side.

* setting.py         ``FsdpSetting``: the workload and the rounds (the script's flags)
* configurations.py  the four configurations, each on its own copy of the model
* formulas.py        the bytes each should move, and the largest model its memory fits
* accounting.py      one counted step: live tensor bytes by part, collective bytes by kind
* tracing.py         one traced step: compute and collective intervals, for the timeline
* run.py             the rank function: build, warm up, interleave, count, trace
* summarize.py       one ``FsdpStepRecord`` per configuration (record.py)
"""

from cs336_systems.bench.fsdp.record import FsdpStepRecord, FsdpTimeline
from cs336_systems.bench.fsdp.run import FsdpRun, run_fsdp_benchmark
from cs336_systems.bench.fsdp.setting import FsdpSetting
