"""The peak memory of a call on the CPU, from torch.profiler's allocation events: the largest sum of
the bytes allocated less those freed while it runs. bench/generic_memory.py measures each side with
it, and the tests of the generic path's and the emulated GPU path's memory bound it
(python_tests/test_generic_path.py, test_cuda_emulation.py)."""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn, skip=()) -> int:
    """The peak of the bytes allocated less those freed while fn() runs, leaving out what the ops named
    in ``skip`` allocate (and free) inside themselves."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    spans = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() in skip]
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    if not memory:
        raise RuntimeError("the profiler recorded no allocations")
    now = top = 0
    for e in memory:
        if any(a <= e.start_ns() <= b for a, b in spans):
            continue
        now += e.nbytes()
        top = max(top, now)
    return top
