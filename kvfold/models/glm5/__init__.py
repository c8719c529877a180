"""GLM-5.3 (`glm5_next`): config, the model and its layers (KDA, indexed MLA with DSA selection),
and its per-sequence state with the DSA indexer cache."""
