"""Section 8's FFN run for real: FLOPs counted by torch, bytes sent measured on gloo ranks.

:func:`count_flops` runs one device's share of the layer (equations (20)–(30)) at the sharded
shapes of DP, FSDP, TP or FSDP + TP under ``torch.utils.flop_counter.FlopCounterMode``, forward and
backward apart. :func:`measure_rank` is one gloo rank of DP, FSDP or TP: it runs that strategy's
forward and backward through real collectives, with communication in FP16 as the handout assumes,
and reads the bytes the process wrote to its sockets from ``/proc/self/io`` (``wchar``, which
counts every write(2)-family call, gloo's socket writes included) around each pass. It also checks
the result: the gradients of its weights (and TP's dx) must equal single-process autograd on the
whole batch.

Collectives: torch's all-reduce and all-gather on gloo are ring algorithms whose bytes per rank
are the handout's; gloo's reduce_scatter_tensor is not (it sends as much as an all-reduce,
2 (N − 1)/N · S), so FSDP's gradients go through :func:`ring_reduce_scatter`, the handout's ring
written with point-to-point sends. :data:`GLOO_REDUCE_SCATTER` measures gloo's own for the record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from cs336_systems.capacity import strategies as st

COMM_DTYPE = torch.float16  # the handout's "weights and activations in FP16"
STRATEGIES = ("DP", "FSDP", "TP", "FSDP+TP")
MEASURED = ("DP", "FSDP", "TP")  # run on gloo ranks
GLOO_REDUCE_SCATTER = "gloo reduce_scatter_tensor"


def ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """Equations (20)–(23) with f = SiLU."""
    return (F.silu(x @ w1) * (x @ w2)) @ w3


def silu_grad(u: torch.Tensor) -> torch.Tensor:
    """f'(u) for f(u) = u·σ(u): σ(u)·(1 + u·(1 − σ(u)))."""
    s = torch.sigmoid(u)
    return s * (1 + u * (1 - s))


def tp_backward(dy, x, x1, x2, z, w1, w2, w3):
    """tp_calcs (a) on device i, before the all-reduce of dx: (24)–(30) on the D_FF/N_TP slice.

    dy and x are whole ([B, D], every device has them); x1, x2, z are this device's [B, D_FF/N]
    slices; w1, w2 its [D, D_FF/N] columns, w3 its [D_FF/N, D] rows. Returns (dW1, dW2, dW3, dx
    partial sum); dx = all-reduce of the partial sums.
    """
    dz = dy @ w3.T
    dx2 = dz * F.silu(x1)
    dx1 = dz * silu_grad(x1) * x2
    return x.T @ dx1, x.T @ dx2, z.T @ dy, dx1 @ w1.T + dx2 @ w2.T


def sharded_shapes(strategy: str, ffn_shape: st.Ffn, n_fsdp: int, n_tp: int) -> tuple[int, int]:
    """(rows of x, columns of W1) on one device: the batch is split by DP, FSDP and 2D's FSDP axis,
    D_FF by TP and 2D's TP axis."""
    b, f = int(ffn_shape.batch), int(ffn_shape.d_ff)
    split = {"DP": (n_fsdp, 1), "FSDP": (n_fsdp, 1), "TP": (1, n_tp), "FSDP+TP": (n_fsdp, n_tp)}[strategy]
    if b % split[0] or f % split[1]:
        raise ValueError(f"{strategy}: B = {b} and D_FF = {f} must split evenly {split[0]} and {split[1]} ways")
    return b // split[0], f // split[1]


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def count_flops(strategy: str, ffn_shape: st.Ffn, n_fsdp: int = 1, n_tp: int = 1) -> tuple[int, int]:
    """(forward, backward) FLOPs torch counts for one device's share of the layer.

    The device holds whole weights (DP, and FSDP once gathered) or its TP slices; TP's backward is
    :func:`tp_backward` (the all-reduce of dx costs no FLOPs), the others' is autograd's, with x
    requiring a gradient since the layer's dx is part of the backward pass.
    """
    rows, cols = sharded_shapes(strategy, ffn_shape, n_fsdp, n_tp)
    d = int(ffn_shape.d_model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=g, requires_grad=True)
    w1, w2 = (torch.randn(d, cols, generator=g, requires_grad=True) for _ in range(2))
    w3 = torch.randn(cols, d, generator=g, requires_grad=True)
    dy = torch.randn(rows, d, generator=g)
    saved: dict[str, torch.Tensor] = {}

    def forward() -> None:
        saved["x1"], saved["x2"] = x @ w1, x @ w2
        saved["z"] = F.silu(saved["x1"]) * saved["x2"]
        saved["y"] = saved["z"] @ w3

    def backward() -> None:
        if strategy == "TP":
            with torch.no_grad():
                tp_backward(dy, x, saved["x1"], saved["x2"], saved["z"], w1, w2, w3)
        else:
            saved["y"].backward(dy)

    return _counted(forward), _counted(backward)


def wchar() -> int:
    """Bytes this process has passed to write(2)-family calls so far (sockets included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line: byte counting needs Linux task I/O accounting")


def _sent_during(fn) -> tuple[object, int]:
    """fn's result and the bytes this rank wrote while it ran, between two barriers."""
    dist.barrier()
    start = wchar()
    out = fn()
    sent = wchar() - start
    dist.barrier()
    return out, sent


def ring_reduce_scatter(full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """The handout's ring reduce-scatter of ``full`` (its first dimension split in n chunks) over
    point-to-point sends: each step passes one partial sum to the right; returns chunk ``rank``."""
    y = list(full.clone().chunk(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for t in range(1, n):
        received = torch.empty_like(y[(rank - t - 1) % n])
        ops = [dist.P2POp(dist.isend, y[(rank - t) % n].contiguous(), right),
               dist.P2POp(dist.irecv, received, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        y[(rank - t - 1) % n] += received
    return y[rank]


def _gather(shard: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty((shard.shape[0] * n, *shard.shape[1:]), dtype=COMM_DTYPE)
    dist.all_gather_into_tensor(out, shard.to(COMM_DTYPE).contiguous())
    return out.float()


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    half = t.to(COMM_DTYPE)
    dist.all_reduce(half)
    return half.float()


@dataclass(frozen=True)
class RankBytes:
    """What one rank sent and computed in one strategy's step."""

    forward_bytes: int
    backward_bytes: int
    max_error: float  # largest |ours − single-process autograd| over the rank's gradients (and TP's dx)


def _reference(ffn_shape: st.Ffn, seed: int):
    b, d, f = int(ffn_shape.batch), int(ffn_shape.d_model), int(ffn_shape.d_ff)
    g = torch.Generator().manual_seed(seed)
    # FP16-representable values, so that sending them in FP16 loses nothing.
    x, dy = (torch.randn(b, d, generator=g).half().float() / 4 for _ in range(2))
    w = [torch.randn(*s, generator=g).half().float() / 8 for s in ((d, f), (d, f), (f, d))]
    xr = x.clone().requires_grad_(True)
    ws = [t.clone().requires_grad_(True) for t in w]
    ffn(xr, *ws).backward(dy)
    return x, dy, w, [t.grad for t in ws], xr.grad


def measure_rank(rank: int, n: int, strategy: str, ffn_shape: st.Ffn, seed: int = 0) -> RankBytes:
    """One rank of ``strategy`` (DP, FSDP, TP or :data:`GLOO_REDUCE_SCATTER`) in a gloo group of n."""
    x, dy, w, grads, dx_ref = _reference(ffn_shape, seed)
    if strategy == GLOO_REDUCE_SCATTER:
        out = torch.empty(int(ffn_shape.d_model) // n, int(ffn_shape.d_ff), dtype=COMM_DTYPE)
        _, sent = _sent_during(lambda: dist.reduce_scatter_tensor(out, w[0].to(COMM_DTYPE)))
        return RankBytes(0, sent, 0.0)
    rows = slice(rank * x.shape[0] // n, (rank + 1) * x.shape[0] // n)
    if strategy in ("DP", "FSDP"):
        shards = [t.chunk(n)[rank] for t in w]  # FSDP keeps 1/N of each weight's rows

        def forward():
            full = [_gather(s, n) for s in shards] if strategy == "FSDP" else w
            xs = x[rows].clone().requires_grad_(True)
            return ffn(xs, *[t.clone().requires_grad_(True) for t in full]), xs

        def backward(out):
            y, xs = out
            full = [_gather(s, n) for s in shards] if strategy == "FSDP" else w
            leaves = [t.clone().requires_grad_(True) for t in full]
            ffn(xs, *leaves).backward(dy[rows])  # recomputed on the gathered weights: no FLOPs counted here
            local = [t.grad for t in leaves]
            if strategy == "DP":
                return [_all_reduce(g) for g in local]
            return [ring_reduce_scatter(g.to(COMM_DTYPE), rank, n).float() for g in local]

        out, fwd = _sent_during(forward)
        mine, bwd = _sent_during(lambda: backward(out))
        want = grads if strategy == "DP" else [g.chunk(n)[rank] for g in grads]
        errors = [(a - b).abs().max().item() for a, b in zip(mine, want)]
    elif strategy == "TP":
        cols = slice(rank * w[0].shape[1] // n, (rank + 1) * w[0].shape[1] // n)
        w1, w2, w3 = w[0][:, cols], w[1][:, cols], w[2][cols]

        def forward():
            x1, x2 = x @ w1, x @ w2
            z = F.silu(x1) * x2
            return _all_reduce(z @ w3), (x1, x2, z)

        (_, (x1, x2, z)), fwd = _sent_during(forward)

        def backward():
            dw1, dw2, dw3, dx_part = tp_backward(dy, x, x1, x2, z, w1, w2, w3)
            return [dw1, dw2, dw3, _all_reduce(dx_part)]

        mine, bwd = _sent_during(backward)
        want = [grads[0][:, cols], grads[1][:, cols], grads[2][cols], dx_ref]
        errors = [(a - b).abs().max().item() for a, b in zip(mine, want)]
    else:
        raise ValueError(f"unknown strategy {strategy!r}; measured: {', '.join(MEASURED)}, {GLOO_REDUCE_SCATTER}")
    return RankBytes(fwd, bwd, max(errors))


def expected_bytes(strategy: str, ffn_shape: st.Ffn, n: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends by the handout's terms: the times of
    :mod:`.strategies` at W = 1 byte/s."""
    if strategy == "DP":
        return 0.0, st.dp_backward_comm_s(ffn_shape, n, 1.0)
    if strategy == "FSDP":
        return st.fsdp_forward_comm_s(ffn_shape, n, 1.0), st.fsdp_backward_comm_s(ffn_shape, n, 1.0)
    if strategy == "TP":
        return st.tp_comm_s(ffn_shape, n, 1.0), st.tp_comm_s(ffn_shape, n, 1.0)
    if strategy == GLOO_REDUCE_SCATTER:
        return 0.0, st.ring_gather_s(ffn_shape.d_model * ffn_shape.d_ff * st.ELEMENT_BYTES, n, 1.0)
    raise ValueError(f"unknown strategy {strategy!r}")
