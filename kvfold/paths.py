"""Where kvfold keeps files it makes for itself (random bench checkpoints, built native kernels)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$KVFOLD_CACHE_DIR, else $XDG_CACHE_HOME/kvfold, else ~/.cache/kvfold."""
    env = os.environ.get("KVFOLD_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvfold"
