"""Optimizer state sharding, accounted for (problem optimizer_state_sharding_accounting): what ZeRO
stage 1 saves in memory and costs in time, for the Transformer LM at one size.

Two configurations train the same data-parallel steps: ``unsharded`` (``torch.optim.AdamW`` on
every rank, each holding the whole optimizer state) and ``sharded``
(:class:`~cs336_systems.zero.ShardedOptimizer` over AdamW, each rank holding the state of the
parameters it owns and broadcasting them after its update).

* setting.py   AccountingSetting: the workload and the rounds (bench_sharded_optimizer.py's flags)
* counting.py  exact byte counts (storages, optimizer state, live tensors) and ZeRO-1's formulas
* meters.py    reading memory: the CUDA allocator on a GPU, the process RSS on a CPU
* run.py       the ranks: warm-up, memory per configuration, interleaved timed rounds
* record.py    AccountingRecord, one per (configuration, rank) in ``sharded_optimizer.json``
"""

from cs336_systems.bench.accounting.counting import (
    CommunicationVolumes,
    communication_bytes_per_rank,
    expected_adam_state_bytes,
    live_tensor_bytes,
    optimizer_state_bytes,
    storage_bytes,
)
from cs336_systems.bench.accounting.meters import (
    CudaAllocatorMeter,
    RssMeter,
    fix_malloc_mmap_threshold,
    meter_for,
    read_proc_status,
)
from cs336_systems.bench.accounting.record import (
    CONFIGURATIONS,
    PHASES,
    SHARDED,
    UNSHARDED,
    AccountingRecord,
    PhaseMemory,
    sharded_minus_unsharded,
)
from cs336_systems.bench.accounting.run import AccountingRun, accounting_rank, run_accounting
from cs336_systems.bench.accounting.setting import AccountingSetting
