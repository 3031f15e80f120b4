"""Weight movement for sleep levels: flat device layout, pinned host pool, file reloads."""

from omnistage_worker.engine.weights import EngineError, TransferStats, WeightEngine, WeightFiles

__all__ = ["EngineError", "TransferStats", "WeightEngine", "WeightFiles"]
