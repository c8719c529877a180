"""DeepSeek-V4: config, checkpoint layouts (and which weights its release quantizes), the model and
its layers (attention, compressor, indexer, MoE router, MTP), and its per-sequence state and snapshots."""
