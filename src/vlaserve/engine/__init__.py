from .batcher import Batcher, BatcherClosed

__all__ = ["Batcher", "BatcherClosed"]
