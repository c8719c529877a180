from .rings import PositionRing
from .dsv4_state import Dsv4State, LayerState

__all__ = ["PositionRing", "Dsv4State", "LayerState"]
