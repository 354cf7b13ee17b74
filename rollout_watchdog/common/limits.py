"""Process limits that the node daemon and the coordinator both raise at start."""

from __future__ import annotations

import resource


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as Go's runtime does); (old soft, new
    soft). Unchanged if the kernel refuses. Children inherit the raised limit: fine for engines
    (SGLang wants many)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft, soft  # Linux caps NOFILE at nr_open, so infinity does not occur there
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return soft, soft
    return soft, hard
