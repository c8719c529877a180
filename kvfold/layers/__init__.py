"""Model building blocks. Each owns its weights (named as in the transformers checkpoint layout)
and computes one chunk of T tokens against a per-layer state; none knows about sequences."""
