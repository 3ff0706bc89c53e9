"""``CS336DDPStrategy`` trains as Lightning's own ``DDPStrategy`` does (torch's DDP), on CPU with gloo.

Reference: the same LightningModule, data and Trainer flags fitted with
``lightning.pytorch.strategies.DDPStrategy`` in the same two processes (tests/lightning_cases.py).
Both average gradients the same way on gloo (divide by the world size, then sum two values, which
is commutative), so in float32 and under autocast the weights must be *equal*, rank by rank,
BatchNorm's running statistics included (those are each rank's own: torch's DDP and ours both
broadcast rank 0's buffers at the start of a forward, so each rank's last update differs).
``sync_batchnorm`` has no CPU reference in torch (its SyncBatchNorm refuses CPU tensors), so
there the reference is one process training on the whole global batch, within float32 rounding
of the one-pass variance (sync_batchnorm.py).

Lightning starts slowly (seconds per process), so each test launches once and fits many
configurations. ``CS336_LIGHTNING_MATRIX=1`` adds every variant to every configuration
(about 2 minutes on 2 cores).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from cs336_systems.launch import RankFailedError, launch
from cs336_systems.lightning import CS336DDPStrategy
from tests.lightning_cases import FAILURE, FitCase, fit_cases_then_fail, fit_single

pytestmark = [pytest.mark.problem("beyond"), pytest.mark.xdist_group("lightning")]

MATRIX = os.environ.get("CS336_LIGHTNING_MATRIX") == "1"
VARIANTS = ("bucketed", "per_parameter", "flat", "naive", "auto")
EVERY = ("lightning", *VARIANTS)


# Each Linear a unit (Lightning's auto_wrap_policy spelling), then the root.
FSDP_CASE = FitCase("fsdp", batchnorm=False, steps=3, resume_at=1, strategies=("lightning", "fsdp"), whole_batch=True,
                    ours={"auto_wrap_policy": {torch.nn.Linear}})
# The same units beside Lightning's own FSDP strategy that runs on CPU: ModelParallelStrategy
# (torch's fully_shard in the module's configure_model). Its FSDPStrategy (FSDP1) refuses a CPU
# accelerator ("requires a GPU accelerator"), so it has no case here.
# gradient_clip_val on SGD: Lightning clips with torch.nn.utils.clip_grad_norm_, which over our
# FSDP's DTensor parameters takes the norm over every rank's shard (issue 47: each rank's own
# shard's norm clipped it before, 6.8e-4 from DDPStrategy after 3 steps).
FSDP_CLIP_CASE = FitCase("fsdp-clip", batchnorm=False, steps=3, clip=0.05, strategies=("lightning", "fsdp"),
                         ours={"auto_wrap_policy": {torch.nn.Linear}})
CLIP_ATOL = 1e-6  # float32 rounding: the norm's squares are summed per shard, then over ranks
MODEL_PARALLEL_CASE = FitCase("fsdp-model-parallel", batchnorm=False, steps=3, strategies=("model_parallel", "fsdp"),
                              ours={"auto_wrap_policy": {torch.nn.Linear}})


def _cases() -> list[FitCase]:
    some = EVERY if MATRIX else ("lightning", "bucketed")
    return [
        FitCase("float32", strategies=EVERY),
        # The held-out script's combination: BatchNorm, bf16 autocast, accumulation, clipping, resume.
        FitCase("bf16-accumulate-clip-resume", steps=3, precision="bf16-mixed", accumulate=2, clip=0.5,
                resume_at=1, strategies=some),
        FitCase("16-mixed", precision="16-mixed", strategies=some),
        FitCase("no-views-small-buckets", strategies=("lightning", "bucketed"),
                ours={"gradient_as_bucket_view": False, "bucket_cap_mb": 0.0005},
                torch_ddp={"gradient_as_bucket_view": False, "bucket_cap_mb": 0.0005}),
        # A parameter no rank uses: allowed when asked for, as DDPStrategy allows it.
        FitCase("unused-parameters", unused=True, strategies=("lightning", "bucketed"),
                ours={"find_unused_parameters": True}, torch_ddp={"find_unused_parameters": True}),
        # Our FSDP under Lightning (no BatchNorm: torch's DDP broadcasts rank 0's running statistics
        # every forward, FSDP keeps each rank's), resumed from its full checkpoint; beside DDP and
        # one process on the global batch.
        FSDP_CASE,
        FSDP_CLIP_CASE,
        MODEL_PARALLEL_CASE,
        FitCase("static-graph", strategies=("lightning", "bucketed") + (VARIANTS[1:] if MATRIX else ()),
                ours={"static_graph": True}, torch_ddp={"static_graph": True}),
    ]


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, atol: float = 0.0) -> None:
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        if atol == 0.0:
            assert torch.equal(got[name], value), f"{what}: {name} differs by {(got[name] - value).abs().max():.3g}"
        else:
            torch.testing.assert_close(got[name], value, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {name}: {m}")


SYNC_BATCHNORM = FitCase("sync-batchnorm", sync_batchnorm=True, strategies=("bucketed", "per_parameter"),
                         whole_batch=True)


@pytest.mark.timeout(400)
def test_same_weights_as_lightning_ddp_strategy_and_a_failing_rank(tmp_path):
    """Every case against Lightning's DDPStrategy; sync_batchnorm=True on two ranks of 4 against one
    process on batches of 8 (fitted in each rank alone); then, in the same two processes
    (Lightning's start-up is most of their cost), rank 1 raises in a training step while rank 0
    waits in its all-reduce: the job ends with rank 1's error, not gloo's timeout on rank 0. A rank
    that hangs instead is ended by the group's timeout and the launcher's deadline (test_rank_exit.py)."""
    cases = [*_cases(), SYNC_BATCHNORM]
    failing = FitCase("fails", fail_rank=1, strategies=("bucketed",))
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=FAILURE):
        launch(fit_cases_then_fail, 2, (cases, str(tmp_path), failing), backend="gloo", device_type="cpu",
               timeout_s=60)
    assert time.monotonic() - start < 350
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    for results in ranks:  # issue 41 item 7: refused as DDPStrategy refuses it, naming the option
        refusal = results.pop("unused_refused")
        assert "spare.weight" in refusal and "find_unused_parameters=True" in refusal, refusal
    for case in cases[:-1]:
        if case in (MODEL_PARALLEL_CASE, FSDP_CLIP_CASE):
            continue  # within float32 rounding, not bitwise: below
        for rank, results in enumerate(ranks):
            got = results[case.name]
            for name in case.strategies[1:]:
                _assert_same(got[name], got["lightning"], f"{case.name}, {name}, rank {rank}")
                if case.resume_at is not None:
                    _assert_same(got[f"{name}/resumed"], got["lightning/resumed"],
                                 f"{case.name}, {name} resumed, rank {rank}")
            if case.accumulate > 1:
                # Only the micro-batch that steps communicates (wrapper's no_sync under Lightning).
                for name in case.strategies[1:]:
                    calls = got[f"{name}/all_reduces"]["per_batch"].tolist()
                    stepping = [calls[i] for i in range(case.accumulate - 1, len(calls), case.accumulate)]
                    quiet = [c for i, c in enumerate(calls) if (i + 1) % case.accumulate]
                    assert quiet and all(c == 0 for c in quiet), f"{name}: all-reduces per batch {calls}"
                    assert all(c > 0 for c in stepping), f"{name}: all-reduces per batch {calls}"
    for rank, results in enumerate(ranks):
        # float32 rounding of two half-batch gradients summed against one whole-batch chain.
        _assert_same(results[FSDP_CASE.name]["fsdp"], results[FSDP_CASE.name]["whole_batch"],
                     f"CS336FSDPStrategy vs one process, rank {rank}", atol=1e-5)
        got = results[FSDP_CLIP_CASE.name]
        _assert_same(got["fsdp"], got["lightning"], f"CS336FSDPStrategy clipped vs DDPStrategy, rank {rank}",
                     atol=CLIP_ATOL)
        # Both reduce-scatter the same per-rank gradients, grouped differently (per Linear and
        # root here, per parameter there): float32 rounding apart, as beside fully_shard elsewhere.
        got = results[MODEL_PARALLEL_CASE.name]
        _assert_same(got["fsdp"], got["model_parallel"], f"CS336FSDPStrategy vs ModelParallelStrategy, rank {rank}",
                     atol=1e-5)
        got = results[SYNC_BATCHNORM.name]
        for name in SYNC_BATCHNORM.strategies:
            # float32 rounding of E[x^2] - E[x]^2 against torch's two-pass variance, over 4 steps.
            _assert_same(got[name], got["whole_batch"], f"sync_batchnorm {name}, rank {rank}", atol=1e-5)


@pytest.mark.timeout(300)
def test_one_device_needs_no_wrapper():
    """devices=1 trains as Lightning's default strategy does, exactly, with no wrapper and no error."""
    [single] = launch(fit_single, 1, (FitCase("one-device"),), backend="gloo", device_type="cpu", timeout_s=120)
    _assert_same(single["ours"], single["single"], "devices=1")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"variant": "ring"}, "variant must be one of"),
        ({"variant": "flat", "bucket_cap_mb": 50}, "applies to variant='bucketed'"),
        ({"variant": "naive", "gradient_as_bucket_view": False}, "applies to variant='bucketed'"),
        ({"bucket_cap_mb": -1}, "bucket_cap_mb must be a finite number of MB > 0, got -1"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a finite number of MB > 0, got 0"),
        ({"variant": "auto", "bucket_cap_mb": 50}, "chooses the bucket size itself"),
        ({"ddp_comm_hook": print}, "no DDP communication hooks"),
        ({"model_averaging_period": 4}, "post-local-SGD"),
        ({"process_group": object()}, "default process group only"),
        ({"mixed_precision": object()}, "Trainer\\(precision=...\\)"),
        ({"no_such_option": 1}, "unknown DDP option 'no_such_option'"),
        ({"static_graph": "yes"}, "static_graph must be True or False"),
    ],
)
def test_options_it_cannot_honour_are_refused_in_one_line(options, message):
    with pytest.raises((ValueError, TypeError), match=message) as error:
        CS336DDPStrategy(**options)
    assert "\n" not in str(error.value)
    assert "bucket_size_mb" not in str(error.value)  # the user's option name, not the wrapper's


def test_options_map_to_the_wrappers():
    assert CS336DDPStrategy(bucket_cap_mb=50, gradient_as_bucket_view=False)._spec.options == {
        "broadcast_buffers": True, "bucket_cap_mb": 50.0, "gradient_as_bucket_view": False}
    assert CS336DDPStrategy(variant="auto")._spec.options["bucket_size_mb"] == "auto"
    assert CS336DDPStrategy(init_sync=False)._spec.options["init_sync"] is False
    assert CS336DDPStrategy(variant="per_parameter", broadcast_buffers=False,
                            find_unused_parameters=True)._spec.options == {"broadcast_buffers": False}


def test_a_lightning_cli_yaml_config_builds_it(tmp_path):
    """As DDPStrategy is set in a LightningCLI config: class_path and init_args. LightningCLI needs
    jsonargparse, a dev dependency (make env installs it; a GPU node's UV=0 Python may lack it)."""
    pytest.importorskip("jsonargparse")
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:\n"
        "    class_path: cs336_systems.lightning.CS336DDPStrategy\n"
        "    init_args: {variant: bucketed, bucket_cap_mb: 50, gradient_as_bucket_view: false, static_graph: true,\n"
        "      init_sync: true, check_reduction: false}\n"
    )
    cli = LightningCLI(pl.LightningModule, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CS336DDPStrategy)
    assert strategy._spec == CS336DDPStrategy(bucket_cap_mb=50, gradient_as_bucket_view=False, static_graph=True)._spec
    assert strategy.init_sync is True and strategy.check_reduction is False


def test_fsdp_options_from_yaml_are_resolved_and_checked_when_built(tmp_path):
    """A YAML config's class paths and dtype names become classes and dtypes when the strategy is
    built; a bad one is refused then, naming it, instead of inside the ranks after they launched."""
    pytest.importorskip("jsonargparse")
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    from cs336_systems.lightning import CS336FSDPStrategy

    def build(init_args: str):
        config = tmp_path / "config.yaml"
        config.write_text("trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:\n"
                          "    class_path: cs336_systems.lightning.CS336FSDPStrategy\n"
                          f"    init_args: {{{init_args}}}\n")
        return LightningCLI(pl.LightningModule, run=False, args=["--config", str(config)],
                            save_config_callback=None).trainer.strategy

    strategy = build("auto_wrap_policy: [torch.nn.TransformerEncoderLayer], compute_dtype: bfloat16")
    assert isinstance(strategy, CS336FSDPStrategy)
    assert strategy._fsdp_kwargs["units"] == {torch.nn.TransformerEncoderLayer}
    assert strategy._fsdp_kwargs["compute_dtype"] is torch.bfloat16
    for init_args, words in (("auto_wrap_policy: [torch.nn.NoSuchLayer]", "'torch.nn.NoSuchLayer', which does not import"),
                             ("auto_wrap_policy: [torch.nn.functional.relu]", "module classes"),
                             ("reduce_dtype: int8", "reduce_dtype must be")):
        with pytest.raises(ValueError) as info:
            build(init_args)
        assert words in str(info.value), (init_args, str(info.value)[-500:])


def test_python_and_yaml_accept_the_same_options():
    """Issue 41 item 7: LightningCLI takes the named arguments only, so every DDP option the
    strategy accepts is one (``init_sync: true`` was accepted in Python, refused in YAML)."""
    import inspect

    from cs336_systems.lightning.options import _ACCEPTED

    named = set(inspect.signature(CS336DDPStrategy.__init__).parameters)
    assert _ACCEPTED <= named, f"accepted in Python only: {sorted(_ACCEPTED - named)}"


def test_registered_under_its_name():
    """Trainer(strategy="cs336_ddp") builds ours, as Trainer(strategy="ddp") builds Lightning's."""
    import lightning.pytorch as pl

    from cs336_systems.lightning import CS336FSDPStrategy

    for name, kind, find_unused in (("cs336_ddp", CS336DDPStrategy, False),
                                    ("cs336_ddp_find_unused_parameters_true", CS336DDPStrategy, True),
                                    ("cs336_fsdp", CS336FSDPStrategy, True)):
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False)
        assert type(trainer.strategy) is kind and name.startswith(trainer.strategy.strategy_name)
        assert trainer.strategy.find_unused_parameters is find_unused
