"""When the decode batch changes its layout (:mod:`.decode_batch`): when waiting requests join
the running rows, how many spare columns a new layout keeps, and when the holes that joins leave
are compacted away. Pure logic: numbers in, a decision out."""

from __future__ import annotations

JOIN_EVERY = 8
"""Steps a waiting request may wait for the next join while the batch runs ..."""
JOIN_PADDING = 512
"""... unless its join pads the running rows with at most this many tokens in all: then it joins
at the next step (a step that small costs what a plain one does while the host, not the
device, sets the pace; a request that waits leaves its slot idle). See :func:`join_now`."""
GRAPH_SPARE = 64
"""With CUDA graphs, a new layout leaves room for up to this many more steps (no more than its
rows still want): each layout is captured anew, so fewer layouts mean fewer captures."""
MIN_HOLES = 64
"""Padding columns the cache may hold beyond its longest row before it is compacted ..."""
HOLE_RATIO = 1.0
"""... and as a share of the longest row."""


def join_now(waiting: list[int], running: int, room: int, since_join: int) -> bool:
    """Whether requests waiting with prompts of ``waiting`` tokens (those that fit) join at this
    step: at once when nothing runs, when they fill the ``room`` left, when their join pads the
    ``running`` rows with at most ``JOIN_PADDING`` tokens, or ``JOIN_EVERY`` steps after the
    last join (``since_join`` steps ago); else they are gathered for a later join."""
    if not waiting:
        return False
    padding = running * (max(waiting) - 1)
    return (
        not running or len(waiting) >= room or padding <= JOIN_PADDING or since_join >= JOIN_EVERY
    )


def spare_columns(left: list[int]) -> int:
    """Room a new layout keeps for rows that still want ``left`` tokens each: what the
    longest still wants, up to :data:`GRAPH_SPARE`."""
    return max(0, min(GRAPH_SPARE, max(left, default=0)))


def should_compact(used: int, longest: int) -> bool:
    """Whether rows of at most ``longest`` tokens spread over ``used`` columns are compacted:
    when their holes reach ``MIN_HOLES`` and ``HOLE_RATIO`` of the longest row."""
    holes = used - longest
    return holes >= MIN_HOLES and holes >= HOLE_RATIO * longest
