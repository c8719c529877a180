"""DeepSeek-V4: config, checkpoint layouts and quantized formats, the model and its layers
(attention, compressor, indexer, MoE router, MTP), and its per-sequence state and snapshots."""
