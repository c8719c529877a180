"""Pure tensor functions: no models, no state. Every function here is unit-testable alone."""
from .norms import rms_norm, unweighted_rms_norm
from .rope import RopeTable, rope_inv_freq, apply_rope
from .fold import pool_windows
from .hc import hc_weights, hc_head_weights
from .topk import topk_lower_index

__all__ = ["rms_norm", "unweighted_rms_norm", "RopeTable", "rope_inv_freq", "apply_rope", "pool_windows",
           "hc_weights", "hc_head_weights", "topk_lower_index"]
