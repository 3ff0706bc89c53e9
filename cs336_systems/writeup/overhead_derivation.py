"""Problem 6b's derivation, as the writeup prints it: prose and algebra only, no measured number.

The closed form ``T(n_b) = o n_b + s / (w n_b)``, the other reading of the backward assumption,
the optimum and its limits, and the recursion on the buckets actually built with a measured
backward; the arithmetic lives in :mod:`cs336_systems.ddp.overhead_model`.
"""

DERIVATION = r"""### Derivation

Let $s$ be the bytes of gradient all-reduced per step, split into $n_b$ buckets. Model one
all-reduce of $b$ bytes as taking $o + b/w$: a fixed cost $o$ per call, plus the bytes moved at
bandwidth $w$. Calls share one communication channel and run one at a time, so a bucket that
becomes ready while an earlier call is still running waits for it.

**When buckets are ready.** Backward computes for a time $B$ set by the model and the batch:
bucketing changes when gradients are *sent*, not how long they take to *compute*, so $B$ does not
depend on $n_b$. The closed form takes $n_b$ equal buckets of $s/n_b$ bytes and a backward exactly
as fast as the channel's bandwidth term, $B = s/w$, so that filling one bucket takes

$$
c = \frac{s}{w\,n_b},
$$

and bucket $k$ ($k = 1, \dots, n_b$) is ready at $r_k = k\,c$. The $o$ is not part of $c$: it is
spent by the channel while a call runs, not by backward while it computes; with it, backward
would last $n_b (o + c) = n_b\,o + s/w$, longer the more buckets it fills.

**The recursion.** Call $f_k$ the time at which bucket $k$'s all-reduce finishes. It starts once
the bucket is ready and the channel is free, and then takes $o + c$:

$$
f_k = \max(r_k,\, f_{k-1}) + o + c, \qquad f_0 = 0 .
$$

We show $f_k = (k+1)\,c + k\,o$. For $k = 1$ the channel is free, so $f_1 = c + o + c$. If the
formula holds for $k$, bucket $k+1$ is ready at $(k+1)\,c \le f_k$ (as $o \ge 0$): it waits for the
channel, and $f_{k+1} = f_k + o + c = (k+2)\,c + (k+1)\,o$. The channel runs behind backward by the
per-call costs accumulated so far, and as backward ended at $s/w$, the overhead left after it is

$$
T(n_b) = f_{n_b} - \frac{s}{w} = o\,n_b + \frac{s}{w\,n_b} .
$$

The first term grows with the number of buckets: every call pays $o$ and none of it is hidden.
The second, the transfer of the last bucket, which cannot start before backward ends, shrinks
with it. One bucket ($n_b = 1$) gives $o + s/w$, one flat all-reduce after backward.

**The other reading.** Had backward taken $o + c$ per bucket (gradients produced exactly as fast as
the channel completes calls), bucket $k$ would be ready at $k\,(o + c)$, just as the channel frees
up: nothing queues, and the time after backward is $o + s/(w\,n_b)$, smallest with as many buckets
as possible. But that backward lasts $n_b\,o + s/w$: counted from its start, the last all-reduce
ends at $(n_b + 1)\,o + s/w + s/(w\,n_b) = T(n_b) + o + s/w$, the same curve moved up by a
constant, with the same optimum. The two readings differ only in booking the queued $o\,n_b$ to
backward or to the time after it; a backward measured alone (compute-only) does not grow with the
bucket count, so the first reading books it where it is seen.

**The optimum.** Treating $n_b$ as a real number, the overhead is smallest where its derivative
vanishes,

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

where the two terms are equal. One bucket of all $s$ bytes is the largest possible, so the cap is
$b_{\mathrm{opt}} = \min(\sqrt{s\,w\,o},\, s)$. A parameter is never split between buckets, so
the bucket holding the largest parameter ($p_{\max}$ bytes) is at least $p_{\max}$; the others
need not be: a cap below $p_{\max}$ sends that parameter alone and fills the rest up to the cap.

**The buckets actually built.** Real buckets are not equal (the first one is capped small,
parameters do not divide evenly) and backward is rarely exactly as fast as the channel. The same
recursion takes both as measured: $b_k$ the payload of bucket $k$ in launch order, $B$ backward's
compute time from the profiler, gradients produced at a constant byte rate over $B$ (a weight's
gradient costs compute in proportion to its size, the tokens being the same for every layer):

$$
r_k = B\,\frac{b_1 + \dots + b_k}{s}, \qquad
f_k = \max(r_k,\, f_{k-1}) + o + \frac{b_k}{w}, \qquad
\text{wait after backward} = f_{n_b} - B .
$$

Two regimes follow. *Communication-bound* ($B$ below the channel's busy time $n_b\,o + s/w$):
buckets queue, and the wait is at least $n_b\,o + s/w - B$. *Compute-bound* ($B$ well above it):
each bucket finds the channel free, and the wait is about $o + b_{n_b}/w$, the last bucket's own
transfer, whatever $n_b$; the $o\,n_b$ term disappears.

All of this assumes the channel runs *beside* compute, on resources backward does not need (a
GPU's copy engines and network, or a spare CPU core). Where it does not (gloo reduces on CPU
threads, and the ranks' compute threads already fill every core), an all-reduce during backward
is not hidden: it takes its core time from backward, and the step pays about the channel's whole
busy time $n_b\,o + s/w$ whatever the bucketing, the cost of one flat all-reduce plus $o$ per
extra call."""
