"""Decoding: next-token sampling, speculative drafters and verification, and the generation loop."""
