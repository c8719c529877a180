"""Placeholder for the MTP drafter (replaced by the real implementation in the next commit)."""
from __future__ import annotations

from .errors import MtpUnavailableError


class MtpDrafter:
    needs_hidden = True

    def __init__(self, model, capacity, max_rewind, temperature, top_p, generator):
        if not getattr(model, "mtp_weights", None):
            raise MtpUnavailableError(
                "speculative='mtp' needs the checkpoint's multi-token-prediction weights, but this "
                "checkpoint has no mtp.* weights; use speculative='ngram' or a checkpoint that ships them")
        raise NotImplementedError("MTP drafting lands in the next commit")
