"""Weight movement for sleep levels: flat device layout, pinned host pool, file reloads."""

from omnistage_worker.engine.flat_weights import EngineError, WeightFiles
from omnistage_worker.engine.weights import TransferStats, WeightEngine

__all__ = ["EngineError", "TransferStats", "WeightEngine", "WeightFiles"]
