"""A model's chat format: OpenAI-shaped messages -> its prompt (`template.py`, `dsv4_encoding.py`), and its
output -> reasoning, content and tool calls (`parsers.py`)."""
