"""Per-sequence state that every model family shares: identity and ownership checks, position rings,
KV rows, the shared page pool and the snapshot framing. Each family's own state lives in its home
(models/deepseek_v4/state.py, models/glm5/state.py)."""
from .rings import PositionRing

__all__ = ["PositionRing"]
