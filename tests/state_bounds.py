"""Every store the package keeps across calls, with its size and its bound, read from the state object
(``sparse_compile.state.STATE``; docs/design.md, "State kept across calls"): what the soak and fault tests check."""

from __future__ import annotations

# the members without a fixed bound hold one entry per live model module, mask, site or thread: the tests keep
# far fewer alive than this
LIVE = 64


def cache_sizes() -> dict[str, tuple[int, int]]:
    """name -> (entries now, bound)."""
    from sparse_compile import report
    from sparse_compile.state import STATE

    reasons = max((sum(p == path for p, _ in e.calls) for e in report.runtime_stats().values() for path, _ in e.calls),
                  default=0)
    # and one "other reasons" row past the cap
    sizes = {"report runtime_stats reasons per site and path": (reasons, report.MAX_REASONS_PER_PATH + 1)}
    for name, (size, bound) in STATE.summary().items():
        sizes[name] = (size, LIVE if bound is None else bound)
    return sizes
