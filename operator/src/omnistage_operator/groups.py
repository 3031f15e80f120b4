"""Where the hand-over loop of each colocation group lives (kept for imports): ``runner``
(``GroupRunner``: serialized rounds per group), ``port`` (``KubeGroupPort``: a round's Kubernetes
side) and ``publisher`` (status and Events after a round).
"""

from __future__ import annotations

from omnistage_operator.port import KubeGroupPort, group_of
from omnistage_operator.runner import GroupRunner

__all__ = ["GroupRunner", "KubeGroupPort", "group_of"]
