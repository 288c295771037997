"""Two pure-PyTorch KIVI KLs, the baselines of bench/run.py: ``strong`` and ``fast``.

Both compute what ``kivi_fast.kernel_kl(prior_z, q_z, lam)`` computes (reverse ratio, median bandwidth over all
n_p + n_q points with numpy's convention for an even count, lam on the diagonal of K_qq / n_q + lam I,
clip, the paper's fixed-ratio gradient w.r.t. q_z), batched [B, n, d] -> [B] or unbatched [n, d] -> [],
with PyTorch alone, as fast as we could make them:

- squared distances by GEMM, ||x||^2 + ||y||^2 - 2 x.y, on points translated near the origin (minus the
  mean of q: the GEMM's rounding scales with the norms, not with the distances). With X = [q; p] only
  the rows of q (q X^T: the fit and the evaluation) and the p-p block (the median) are formed, 3 n^2 d
  multiply-adds instead of 4 n^2 d. Tall-skinny samples (d >= 8192) go through d in chunks (on a CPU
  cache-sized, on a GPU a few, each a few launches), each translated and converted on the fly, the
  Grams accumulated. Batched float64 on a CPU with d <= 32: the norms folded into the GEMM,
  [x, |x|^2, 1] [-2y, 1, |y|^2]^T, which saves a broadcast pass over the output;
- the median over the N (N - 1) / 2 distinct pairs, exact: up to 2^17 pairs, gathered by one cached
  index (sorted: on a CPU a ``gather``, ~0.65x ``index_select``'s time), then on a CPU one ``topk`` of
  the upper half on the distances' bit patterns (non-negative floats order as their integer views, and
  integer comparisons take about half ``kthvalue``'s time on floats) and the two least of it; elsewhere
  one ``kthvalue`` (the upper middle value, for an even count, by elementwise passes); above,
  a sampled bracket (a sorted sample of 4096 entries brackets the middle ranks, one compare-and-count
  pass over the blocks, the same on the values inside, ``kthvalue`` when few are left or on a miss: on
  a GPU a sort of all pairs, ``_sorts_long_rows``);
- lam added in place on the diagonal of the kernel's q block, solved as (K_qq + n_q lam I) x =
  K_qp 1 / (lam n_p) (a Cholesky factor's solve by two triangular solves on a CPU: ~2% faster than
  ``cholesky_solve``); the ratio at the points q is then r = n_q lam x exactly, which saves the
  evaluation's pass and its cancellation of terms of size ~1/lam;
- a custom ``torch.autograd.Function`` whose forward keeps the gradient's weights
  W_jc = w_c k(c, q_j) (minus r_j on the diagonal: q_j is centre j) and the row scales
  1 / (n_q sigma^2 r_j) (0 where clipped), so that the backward is two GEMMs on saved tensors,
  grad = -s * (W_q q + W_p p); it never differentiates through the fit.

They differ in what runs in float32 for float32 inputs (float64 inputs run in float64 on both sides,
but for strong's refined float32 factor):

- ``strong`` meets kivi_fast's accuracy contract (float32 results within 1e-3 relative of the float64
  oracle; bench/precision.py: ~1e-5 at worst): distances, kernel, median, fit in float64 (a float32 Gram
  or fit loses the contract: the fit amplifies rounding by ~1/lam), and float32 only where
  bench/precision.py measures it safe: the backward's product (float32 weights times the float32
  samples) and, above 256 rows, the Cholesky factor, whose solve is refined in float64 until the
  residual is at float64's level (LAPACK's dsposv scheme; the float64 factor where float32 cannot
  factor or the refinement stalls). Up to 256 rows, float64 Cholesky.
- ``fast`` is the fastest in float32: everything in the input dtype, LU (``linalg.solve_ex``) up to 256
  rows, Cholesky above. It misses the contract on many inputs (bench/precision.py counts them).

On a GPU and under ``torch.compile`` a failed factorization or a zero median gives NaN for its element
instead of an error (as kivi_fast's CUDA ops), so that no check stalls the host. Eagerly on a GPU,
strong's refinement above 256 rows and the sampled median above 2^17 pairs still read values back (a
few reads a call, where a sort of all pairs, which reads none, moves every pair several times). Under
``torch.compile`` (bench/run.py and bench/gpu.py ``--compiled``) nothing does, so that a call is one
graph: the distances are formed without ``out=`` into views of one buffer, the median gathers every
pair at any size for one ``kthvalue`` (on a GPU above 2^17 pairs, one sort, with its copy and int64
indices; the sampled bracket reads counts back; N (N - 1) / 2 more values held), strong factors in
float64 above 256 rows (its refinement loop reads residuals back), and the steps run out of place
(torch 2.11's dynamo got the backward's in-place ones wrong). Compiled on a GPU, where a CUDA graph may
capture the call, both sides solve by Cholesky and two triangular solves, fast at every size (MAGMA's
batched LU and Cholesky solves cannot be captured).
"""

from __future__ import annotations

import contextlib

import torch

SIDES = ("strong", "fast")
_TALL_D = 8192          # d from which the Grams accumulate over chunks of d
_CHUNK_BYTES = 1 << 20  # a chunk of the translated points [N, chunk] in the compute dtype: on a CPU
_GPU_CHUNK_BYTES = 1 << 24  # and on a GPU, where a chunk costs launches, not cache misses
_SMALL_PAIRS = 1 << 17  # up to this many pairs per element: gather them all and one selection
_SAMPLE = 4096          # pairs in the sample that brackets the middle ranks
_LU_ROWS = 256          # fast: LU up to this many rows; strong: float64 Cholesky up to this many

_TRIU_CACHE: dict = {}
_CAPTURING = False  # set by capturing(): the call is being captured in a CUDA graph


@contextlib.contextmanager
def capturing():
    """Calls in this block are to be captured in a CUDA graph eagerly (bench/gpu.py --graphed, its
    warm-up as well as the capture, so that both take the same path): they take the same capturable
    paths as compiled calls, with no value read back to the host (the median's sampled bracket,
    strong's refinement loop) and no MAGMA solve (its batched kernels allocate during the call)."""
    global _CAPTURING
    old, _CAPTURING = _CAPTURING, True
    try:
        yield
    finally:
        _CAPTURING = old


def capture(run):
    """run() captured in a CUDA graph, after three warm-up calls on a side stream (torch's recipe for a
    capture with autograd in it), the pure sides on their capturable paths (capturing()) for both;
    returns the graph's replay."""
    with capturing():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    return graph.replay


def _no_host_reads() -> bool:
    """Whether the call may not read a value back to the host: compiled (it would break the graph) or
    captured in a CUDA graph."""
    return _CAPTURING or torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------------------
# Distances.

def _sqdists(q: torch.Tensor, p: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Squared distances in dt of X = [q; p] - t (t the mean of q): q against [q; p] ([B, n_q, N], the
    fit and the evaluation) and p against p ([B, n_p, n_p], the median only), for the small median views
    of one buffer [B, n_q N + n_p^2] (returned third, else None), by GEMM,
    ||x||^2 + ||y||^2 - 2 x.y: the norms written first and the GEMM accumulated onto them in place.
    Not clamped at 0 (a rounding below 0 is as good as 0 in the kernel); the diagonals are set to 0.
    Tall-skinny samples (d >= 8192) take ``_tall_grams``.
    """
    bsz, n_q, d = q.shape
    n_p = p.shape[1]
    n = n_q + n_p
    if torch.compiler.is_compiling():
        return _sqdists_traced(q, p, dt)
    if n * (n - 1) // 2 <= _SMALL_PAIRS or _no_host_reads():  # one buffer: the gathered median's one index_select
        both = torch.empty(bsz, n_q * n + n_p * n_p, dtype=dt, device=q.device)
        d2 = both[:, : n_q * n].view(bsz, n_q, n)
        d2_pp = both[:, n_q * n:].view(bsz, n_p, n_p)
    else:  # separate, so that the p-p block is freed after the median
        both = None
        d2 = torch.empty(bsz, n_q, n, dtype=dt, device=q.device)
        d2_pp = torch.empty(bsz, n_p, n_p, dtype=dt, device=q.device)
    if d >= _TALL_D:
        g, g_pp = _tall_grams(q, p, dt)
        sq = torch.cat([g[:, :, :n_q].diagonal(dim1=-2, dim2=-1), g_pp.diagonal(dim1=-2, dim2=-1)], 1)
        torch.add(sq[:, :n_q, None], sq[:, None, :], out=d2).add_(g, alpha=-2.0)
        torch.add(sq[:, n_q:, None], sq[:, None, n_q:], out=d2_pp).add_(g_pp, alpha=-2.0)
    elif bsz > 1 and d <= 32 and dt == torch.float64 and q.device.type == "cpu":
        # batched, few dimensions: the norms folded into the GEMM, [x, |x|^2, 1] [-2y, 1, |y|^2]^T, so
        # that no broadcast pass over the [B, n_q, N] output is needed (the per-element GEMMs are tiny)
        l = torch.empty(bsz, n, d + 2, dtype=dt, device=q.device)
        r = torch.empty(bsz, n, d + 2, dtype=dt, device=q.device)
        t = q.mean(1, keepdim=True, dtype=dt)
        torch.sub(q, t, out=l[:, :n_q, :d])
        torch.sub(p, t, out=l[:, n_q:, :d])
        x = l[..., :d]
        sq = x.square().sum(-1)
        l[..., d] = sq
        l[..., d + 1] = 1.0
        torch.mul(x, -2.0, out=r[..., :d])
        r[..., d] = 1.0
        r[..., d + 1] = sq
        torch.bmm(l[:, :n_q], r.mT, out=d2)
        torch.bmm(l[:, n_q:], r[:, n_q:].mT, out=d2_pp)
    else:
        x = torch.empty(bsz, n, d, dtype=dt, device=q.device)
        t = q.mean(1, keepdim=True, dtype=dt)
        torch.sub(q, t, out=x[:, :n_q])
        torch.sub(p, t, out=x[:, n_q:])
        xq, xp = x[:, :n_q], x[:, n_q:]
        sq = x.square().sum(-1)
        torch.add(sq[:, :n_q, None], sq[:, None, :], out=d2).baddbmm_(xq, x.mT, alpha=-2.0)
        torch.add(sq[:, n_q:, None], sq[:, None, n_q:], out=d2_pp).baddbmm_(xp, xp.mT, alpha=-2.0)
    d2[:, :, :n_q].diagonal(dim1=-2, dim2=-1).zero_()
    d2_pp.diagonal(dim1=-2, dim2=-1).zero_()
    return d2, d2_pp, both


def _sqdists_traced(q: torch.Tensor, p: torch.Tensor, dt: torch.dtype):
    """``_sqdists`` under torch.compile: the same values without ``out=`` into views of a buffer (dynamo
    breaks the graph at each; inductor plans the buffers itself) and without the tall path's chunks,
    always in one buffer for ``_median_small``."""
    n_q, n_p = q.shape[1], p.shape[1]
    x = torch.cat([q, p], 1).to(dt) - q.mean(1, keepdim=True, dtype=dt)
    xq, xp = x[:, :n_q], x[:, n_q:]
    sq = x.square().sum(-1)
    d2 = torch.baddbmm(sq[:, :n_q, None] + sq[:, None, :], xq, x.mT, alpha=-2.0)
    d2_pp = torch.baddbmm(sq[:, n_q:, None] + sq[:, None, n_q:], xp, xp.mT, alpha=-2.0)
    d2[:, :, :n_q].diagonal(dim1=-2, dim2=-1).zero_()
    d2_pp.diagonal(dim1=-2, dim2=-1).zero_()
    n = n_q + n_p
    both = torch.cat([d2.flatten(1), d2_pp.flatten(1)], 1)
    return both[:, : n_q * n].view(-1, n_q, n), both[:, n_q * n:].view(-1, n_p, n_p), both


def _tall_grams(q: torch.Tensor, p: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The Grams xq X^T and xp xp^T of X = [q; p] - t in dt, for d >= 8192: d in chunks of ~1 MB, each
    translated and converted into a buffer that stays in cache, and the products accumulated over the
    chunks. No [B, N, d] copy in dt: a float32 -> float64 copy of (100, 50000) is 80 MB of fresh pages
    every call, which made the whole call 1.4-2.2x slower on a CPU. On a GPU the chunks are 16 MB: a
    chunk is ~5 launches whatever its size, and 1 MB ones made the call host-bound (77 chunks at
    (100, 50000) in float64: strong took 15.3 ms on an H200, 3.4 with 16 MB chunks), while the whole copy would hold
    50 MB at (10, 314000). Up to 64 points the full X X^T is one GEMM per chunk (at (10, 314000) 1-8%
    faster than the two GEMMs of 10 rows). (Forming only the upper halves of the symmetric q-q and p-p
    blocks, 2.5 n^2 d multiply-adds instead of 3 n^2 d, measured no faster: the smaller GEMMs run at a
    lower rate.)"""
    bsz, n_q, d = q.shape
    n_p = p.shape[1]
    n = n_q + n_p
    chunk_bytes = _CHUNK_BYTES if q.device.type == "cpu" else _GPU_CHUNK_BYTES
    chunk = max(256, chunk_bytes // (n * torch.finfo(dt).bits // 8))
    full = n <= 64
    if full:
        g = torch.zeros(bsz, n, n, dtype=dt, device=q.device)
    else:
        g = torch.zeros(bsz, n_q, n, dtype=dt, device=q.device)
        g_pp = torch.zeros(bsz, n_p, n_p, dtype=dt, device=q.device)
    for s in range(0, d, chunk):
        e = min(s + chunk, d)
        x = torch.empty(bsz, n, e - s, dtype=dt, device=q.device)  # the same pages every chunk
        t = q[..., s:e].mean(1, keepdim=True, dtype=dt)
        torch.sub(q[..., s:e], t, out=x[:, :n_q])
        torch.sub(p[..., s:e], t, out=x[:, n_q:])
        if full:
            g.baddbmm_(x, x.mT)
        else:
            g.baddbmm_(x[:, :n_q], x.mT)
            g_pp.baddbmm_(x[:, n_q:], x[:, n_q:].mT)
    return (g[:, :n_q], g[:, n_q:, n_q:]) if full else (g, g_pp)


# ---------------------------------------------------------------------------------------------------
# Median bandwidth.

def _upper_middle_(pairs: torch.Tensor, lo: torch.Tensor, k: int) -> torch.Tensor:
    """The (k+1)-th smallest along the last dim (1-based) given the k-th, lo: lo again on a tie, else
    the smallest value above lo. Overwrites ``pairs``; elementwise passes instead of a second selection."""
    le = pairs <= lo.unsqueeze(-1)
    tie = torch.count_nonzero(le, -1) >= k + 1
    return torch.where(tie, lo, pairs.masked_fill_(le, torch.inf).amin(-1))


def _pair_index(n_q: int, n_p: int, device) -> torch.Tensor:
    """Flat positions of the distinct pairs in [d2 (n_q x N) | d2_pp (n_p x n_p)], cached: the q-q upper
    triangle, the q-p block, the p-p upper triangle."""
    key = (n_q, n_p, str(device))
    tracing = torch.compiler.is_compiling()  # a traced graph computes it: the cache would enter its guards
    if not tracing and key in _TRIU_CACHE:
        return _TRIU_CACHE[key]
    n = n_q + n_p
    rq, cq = torch.triu_indices(n_q, n_q, offset=1, device=device)
    rp, cp = torch.triu_indices(n_p, n_p, offset=1, device=device)
    qp = (torch.arange(n_q, device=device)[:, None] * n + n_q + torch.arange(n_p, device=device)).flatten()
    index = torch.cat([rq * n + cq, qp, n_q * n + rp * n_p + cp])
    if not tracing:
        if index.device.type == "cpu":  # sorted for the CPU gather's locality (traced, every call: not there)
            index = index.sort().values
        _TRIU_CACHE[key] = index
    return index


def _sorts_long_rows(t: torch.Tensor) -> bool:
    """Whether a selection over more than _SMALL_PAIRS values sorts them: off the CPU, where kthvalue
    gives each row to one thread block (measured on an H100: csrc/generic.cpp, median_of_pairs). Under
    torch.compile, which gathers every pair, and where the eager bracket misses."""
    return t.device.type != "cpu"


def _median_small(both: torch.Tensor, n_q: int, n_p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two middle squared distances over the distinct pairs ([B] each) from ``_sqdists``' buffer:
    all pairs gathered by one cached index; eagerly on a CPU one topk of their upper half (as integers)
    and its two least; elsewhere one kthvalue and the upper middle value by elementwise passes, or on a
    GPU, more than _SMALL_PAIRS a row, a sort and the middles read off."""
    idx = _pair_index(n_q, n_p, both.device)
    cpu_eager = both.device.type == "cpu" and not torch.compiler.is_compiling()
    if cpu_eager:  # (~0.65x index_select's time on dim 1)
        pairs = torch.gather(both, 1, idx.expand(both.shape[0], -1))
    else:
        pairs = both.index_select(1, idx)
    m = pairs.shape[1]
    k = (m + 1) // 2  # 1-based rank of the lower middle
    if m > _SMALL_PAIRS and _sorts_long_rows(pairs):
        ordered = torch.sort(pairs, dim=-1).values
        return ordered[:, k - 1], ordered[:, m // 2]
    if cpu_eager:
        # the values of ranks k..m by one topk on the bit patterns (non-negative floats order as their
        # same-width integer views; integer comparisons, ~2x kthvalue's float ones), then the two
        # smallest of those
        it = torch.int64 if pairs.dtype == torch.float64 else torch.int32
        top = torch.topk(pairs.clamp_min_(0).view(it), m - k + 1, dim=-1, sorted=False).values
        if m % 2:
            lo = top.amin(-1).view(pairs.dtype)
            return lo, lo
        two = torch.topk(top, 2, dim=-1, largest=False, sorted=True).values.view(pairs.dtype)
        return two[:, 0], two[:, 1]
    lo = torch.kthvalue(pairs, k, dim=-1).values
    hi = lo if m % 2 else _upper_middle_(pairs, lo, k)
    return lo, hi


def _bracket(sample: torch.Tensor, total: int, r_lo: int, r_hi: int) -> tuple[float, float]:
    """Values that bracket ranks r_lo..r_hi (0-based) of a multiset of ``total`` values, from a sorted
    uniform sample of it: the ranks' place in the sample +- 4 standard deviations of a binomial count."""
    size = sample.numel()
    half = int(4.0 * (0.25 * size) ** 0.5) + 1
    a = int(r_lo / total * size) - half
    b = int(r_hi / total * size) + half + 1
    return (float(sample[a]) if a >= 0 else -float("inf")), (float(sample[b]) if b < size else float("inf"))


def _split(values: torch.Tensor, lo: float, hi: float) -> tuple[int, torch.Tensor]:
    """(how many values are below lo, the values in [lo, hi]): three elementwise passes and a gather."""
    mask = values >= lo
    below = values.numel() - int(torch.count_nonzero(mask))
    return below, values[mask.logical_and_(values <= hi)]


def _select(values: torch.Tensor, r_lo: int, r_hi: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of ranks r_lo <= r_hi (0-based) of a 1-D tensor, exactly: a
    sampled bracket, one compare-and-count pass and a recursion on the values inside; kthvalue when
    few are left or the bracket misses (on a GPU, above _SMALL_PAIRS values, a sort)."""
    total = values.numel()
    if total > _SMALL_PAIRS:
        idx = torch.randint(0, total, (_SAMPLE,), generator=gen, device=values.device)
        lo_v, hi_v = _bracket(torch.sort(values[idx]).values, total, r_lo, r_hi)
        below, inside = _split(values, lo_v, hi_v)
        if below <= r_lo and r_hi < below + inside.numel():
            if lo_v == hi_v:  # ties: the ranks hold that one value
                return inside[0], inside[0]
            if inside.numel() <= total // 2:
                return _select(inside, r_lo - below, r_hi - below, gen)
    if total > _SMALL_PAIRS and _sorts_long_rows(values):
        ordered = torch.sort(values).values
        return ordered[r_lo], ordered[r_hi]
    lo = torch.kthvalue(values, r_lo + 1).values
    if r_hi == r_lo:
        return lo, lo
    if r_hi == r_lo + 1:
        return lo, _upper_middle_(values.clone(), lo, r_lo + 1)
    return lo, torch.kthvalue(values, r_hi + 1).values


def _median_bracket(d2_q: torch.Tensor, d2_pp: torch.Tensor, gen: torch.Generator):
    """The same two middle values for one element ([n_q, N], [n_p, n_p]) without gathering the pairs.

    The blocks (q-q and p-p as full symmetric blocks with their zero diagonals, q-p counted twice) hold
    the N^2 entries of the full distance matrix: the N zeros of its diagonal and every distinct pair
    twice, so the pair of rank k (0-based) is the entry of rank N + 2 k. A sorted uniform sample of
    4096 entries brackets the two middle ranks; one pass over the blocks counts the entries below the
    bracket and gathers those inside (a few percent), among which ``_select`` goes on.
    """
    n_q, n = d2_q.shape
    a, qp = d2_q[:, :n_q], d2_q[:, n_q:]
    m = n * (n - 1) // 2
    r_lo, r_hi = n + 2 * ((m - 1) // 2), n + 2 * (m // 2)
    i = torch.randint(0, n, (_SAMPLE,), generator=gen, device=d2_q.device)
    j = torch.randint(0, n, (_SAMPLE,), generator=gen, device=d2_q.device)
    i, j = torch.minimum(i, j), torch.maximum(i, j)  # entry (i, j) of the full matrix, i <= j
    qi, qj, pi, pj = i.clamp(max=n_q - 1), j.clamp(max=n_q - 1), (i - n_q).clamp(min=0), (j - n_q).clamp(min=0)
    sample = torch.where(j < n_q, a[qi, qj], torch.where(i < n_q, qp[qi, pj], d2_pp[pi, pj]))
    lo_v, hi_v = _bracket(torch.sort(sample).values, n * n, r_lo, r_hi)
    (na, ia), (nqp, iqp), (npp, ipp) = (_split(x, lo_v, hi_v) for x in (a, qp, d2_pp))
    below, inside = na + 2 * nqp + npp, torch.cat([ia, iqp, iqp, ipp])
    if below <= r_lo and r_hi < below + inside.numel():
        return _select(inside, r_lo - below, r_hi - below, gen)
    # the bracket missed: all pairs, one selection
    both = torch.cat([d2_q.reshape(1, -1), d2_pp.reshape(1, -1)], 1)
    lo, hi = _median_small(both, n_q, n - n_q)
    return lo[0], hi[0]


def _median_sqdist(d2_q: torch.Tensor, d2_pp: torch.Tensor, both: torch.Tensor):
    """The two middle squared distances over the distinct pairs of the N points, [B] each."""
    n_q, n = d2_q.shape[1:]
    if n * (n - 1) // 2 <= _SMALL_PAIRS or _no_host_reads():  # (the bracket reads values back)
        return _median_small(both, n_q, n - n_q)
    gen = torch.Generator(device=d2_q.device).manual_seed(0)
    out = [_median_bracket(d2_q[b], d2_pp[b], gen) for b in range(d2_q.shape[0])]
    return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])


# ---------------------------------------------------------------------------------------------------
# The fit's linear system, (K_qq + n_q lam I) x = K_qp 1 / (lam n_p).

def _may_read_back(t: torch.Tensor) -> bool:
    """Whether a check may read a value of t back to the host to raise an error: eagerly on the CPU. On
    a GPU the read would stall the host, and under torch.compile it would break the graph: NaN for the
    failed batch element instead, as kivi_fast's CUDA ops give."""
    return t.device.type == "cpu" and not _no_host_reads()


def _checked(x: torch.Tensor, info: torch.Tensor, message: str) -> torch.Tensor:
    """x, or an error where a factorization failed (info != 0); NaN for the failed elements where a
    check may not read back (_may_read_back)."""
    if not _may_read_back(x):
        return torch.where((info == 0)[..., None, None], x, torch.nan)
    if bool((info != 0).any()):
        raise ValueError(message)
    return x


def _in_cuda_graph(t: torch.Tensor) -> bool:
    """Whether t's solve may be captured in a CUDA graph (compiled on a GPU: torch.compile's
    reduce-overhead; or captured eagerly, capturing()). There MAGMA's batched kernels behind
    torch.cholesky_solve and torch.linalg.solve_ex allocate during the call, which a capture refuses
    (torch 2.11, an H200); the Cholesky factor and cuBLAS's triangular solves are captured."""
    return t.is_cuda and _no_host_reads()


def _cholesky_solve(b: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """chol chol^T x = b: two triangular solves eagerly on a CPU (~2% faster) and where the call may be
    captured (_in_cuda_graph)."""
    if _in_cuda_graph(chol) or (chol.device.type == "cpu" and not torch.compiler.is_compiling()):
        y = torch.linalg.solve_triangular(chol, b, upper=False)
        return torch.linalg.solve_triangular(chol.mT, y, upper=True)
    return torch.cholesky_solve(b, chol)


def _solve_fast(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a x = b in a's dtype: LU up to 256 rows (batched small systems), Cholesky above, and Cholesky
    at every size where the call may be captured in a CUDA graph (_in_cuda_graph)."""
    if a.shape[-1] <= _LU_ROWS and not _in_cuda_graph(a):
        x, info = torch.linalg.solve_ex(a, b)
    else:
        chol, info = torch.linalg.cholesky_ex(a)
        x = _cholesky_solve(b, chol)
    return _checked(x, info, "K_qq / n_q + lam I could not be factored; increase lam")


def _solve_strong(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a x = b, float64 a and b: Cholesky up to 256 rows; above, a float32 factor and the solve refined
    in float64 until the residual is at float64's level (LAPACK's dsposv scheme: the float32 factor
    takes half the time), the float64 factor where float32 cannot factor or the refinement stalls."""
    if a.shape[-1] > _LU_ROWS and not _no_host_reads():  # (its loop reads back residuals)
        chol32, info = torch.linalg.cholesky_ex(a.to(torch.float32))
        if not bool((info != 0).any()):
            # ||r|| <= sqrt(n) eps ||a|| ||x|| (infinity norms; a's entries are >= 0)
            tol = a.shape[-1] ** 0.5 * torch.finfo(torch.float64).eps * a.sum(-1).amax(-1)[:, None, None]
            x = torch.cholesky_solve(b.float(), chol32).double()
            for _ in range(10):
                res = torch.baddbmm(b, a, x, alpha=-1.0)
                if bool((res.abs().amax((-2, -1), keepdim=True) <= tol * x.abs().amax((-2, -1), keepdim=True)).all()):
                    return x
                x += torch.cholesky_solve(res.float(), chol32)
    chol, info = torch.linalg.cholesky_ex(a)
    return _checked(_cholesky_solve(b, chol), info, "K_qq / n_q + lam I is not positive definite in float64; increase lam")


# ---------------------------------------------------------------------------------------------------
# The estimator.

def _forward(q: torch.Tensor, p: torch.Tensor, lam: float, clip: float, side: str, need_grad: bool):
    """[B, n_q, d], [B, n_p, d] -> (KL [B] in the input dtype, the backward's (W, s) or None)."""
    bsz, n_q = q.shape[:2]
    n_p = p.shape[1]
    strong = side == "strong"
    dt = torch.float64 if strong else q.dtype  # distances, kernel, fit and evaluation
    d2, d2_pp, both = _sqdists(q, p, dt)                             # [B, n_q, N], [B, n_p, n_p]
    lo, hi = _median_sqdist(d2, d2_pp, both)
    del d2_pp, both
    sigma = 0.5 * (lo.clamp_min(0).sqrt() + hi.clamp_min(0).sqrt())   # [B]
    if not _may_read_back(sigma):
        sigma = torch.where(sigma == 0, torch.nan, sigma)
    elif bool((sigma == 0).any()):
        raise ValueError("the median pairwise distance is 0; the median bandwidth is undefined")
    traced = torch.compiler.is_compiling()
    if traced:  # out of place, as _fixed_ratio_grad compiled
        k = torch.exp(d2 * (-0.5 / sigma**2)[:, None, None])
    else:
        k = d2.mul_((-0.5 / sigma**2)[:, None, None]).exp_()         # [B, n_q, N], the kernel, in place

    # fit: alpha = -x, (K_qq + n_q lam I) x = K_qp 1 / (lam n_p) (the paper's system times n_q), lam
    # added in place on the diagonal of the kernel's q block (put back to k(q_j, q_j) = 1 after). At the
    # points q the fitted ratio is r = K_qq alpha + K_qp 1 / (lam n_p) = n_q lam x: no evaluation pass,
    # and none of its cancellation of terms of size ~1/lam.
    k_qq = k[:, :, :n_q]
    b = k[:, :, n_q:].sum(-1, keepdim=True).div_(lam * n_p)          # [B, n_q, 1]
    solve = _solve_strong if strong else _solve_fast
    if traced:
        x_fit = solve(k_qq + (n_q * lam) * torch.eye(n_q, dtype=dt, device=k.device), b)[..., 0]
    else:
        k_qq.diagonal(dim1=-2, dim2=-1).add_(n_q * lam)
        x_fit = solve(k_qq, b)[..., 0]
        k_qq.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    r = x_fit * (n_q * lam)                                           # [B, n_q]
    value = -torch.log(r.clamp_min(clip)).mean(-1)
    if not need_grad:
        return value.to(q.dtype), None

    # grad_j = -s_j sum_c w_c k_jc (c - q_j), s_j = 1 / (n_q sigma^2 r_j) (0 where clipped),
    # w = [alpha; 1 / (lam n_p)]: = -s_j (W X)_j with W_jc = w_c k_jc minus r_j on the q block's diagonal
    # (q_j is centre j; W X = W (X - t) for any t). The product runs in the input dtype: float32 for
    # float32 inputs on both sides (strong: measured by bench/precision.py, ~1e-5 against the contract's
    # 1e-3), on the samples as given.
    s = torch.where(r > clip, 1.0 / (n_q * sigma[:, None] ** 2 * r), 0.0)  # [B, n_q]
    w = torch.cat([-x_fit, x_fit.new_full((bsz, n_p), 1.0 / (lam * n_p))], 1)
    if traced:  # out of place, as _fixed_ratio_grad compiled
        weights = k.to(q.dtype) * w.to(q.dtype)[:, None, :]
        weights = weights - torch.nn.functional.pad(torch.diag_embed(r.to(q.dtype)), (0, n_p))
    else:
        weights = k.to(q.dtype).mul_(w.to(q.dtype)[:, None, :])
        weights[:, :, :n_q].diagonal(dim1=-2, dim2=-1).sub_(r.to(q.dtype))
    return value.to(q.dtype), (weights, s.to(q.dtype))


class _KL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, p, lam, clip, side, need_grad):
        value, saved = _forward(q, p, lam, clip, side, need_grad)
        if saved is not None:
            ctx.save_for_backward(*saved, q, p)
        return value

    @staticmethod
    def backward(ctx, grad_out):
        weights, s, q, p = ctx.saved_tensors
        return _fixed_ratio_grad(weights, s, q, p, grad_out), None, None, None, None, None


def _fixed_ratio_grad(weights, s, q, p, grad_out):
    """grad q = -grad_out s (W [q; p]): two GEMMs on the saved tensors (the fit is held fixed)."""
    n_q, n = weights.shape[1:]
    scale = (-grad_out.to(s.dtype)[:, None] * s)[..., None]              # [B, n_q, 1]
    if torch.compiler.is_compiling():  # out of place: Inductor plans the buffers itself
        return torch.baddbmm(torch.bmm(weights[:, :, :n_q], q), weights[:, :, n_q:], p) * scale
    if n <= q.shape[-1]:  # scale the smaller of the weights and the gradient
        weights = weights * scale
    grad = torch.bmm(weights[:, :, :n_q], q).baddbmm_(weights[:, :, n_q:], p)
    if n > q.shape[-1]:
        grad.mul_(scale)
    return grad


def kl(prior_z: torch.Tensor, q_z: torch.Tensor, lam: float = 1e-3, clip: float = 1e-8,
       side: str = "strong") -> torch.Tensor:
    """KL(q || p) by KIVI with the reverse ratio trick; [n, d] -> [] or [B, n, d] -> [B].

    Differentiable w.r.t. ``q_z`` (fixed-ratio gradient); ``prior_z`` gets none. ``side`` is
    ``"strong"`` (meets the 1e-3 contract) or ``"fast"`` (float32 throughout for float32 inputs).
    """
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    batched = q_z.dim() == 3
    q = q_z if batched else q_z.unsqueeze(0)
    p = (prior_z if batched else prior_z.unsqueeze(0)).detach()
    need_grad = q.requires_grad and torch.is_grad_enabled()
    if need_grad and torch.compiler.is_compiling():
        # torch 2.11's dynamo traced _KL into a gradient of 0 (backend "eager" too; an H200 lease, torch
        # 2.13 here is right): compiled, the gradient is computed in the forward and joins the value
        # through a surrogate of plain ops, sum(q * grad), whose gradient AOTAutograd derives itself
        with torch.no_grad():
            value, (weights, s) = _forward(q.detach(), p, float(lam), float(clip), side, True)
            grad = _fixed_ratio_grad(weights, s, q.detach(), p, torch.ones_like(value))
        surrogate = (q * grad).sum((-2, -1))
        out = value + (surrogate - surrogate.detach())
    else:
        out = _KL.apply(q, p, float(lam), float(clip), side, need_grad)
    return out if batched else out[0]

