"""Chat encodings: OpenAI-shaped messages -> the prompt text a model was trained on."""
