"""A model's chat format: OpenAI-shaped messages -> its prompt (`template.py`, `dsv4_encoding.py`; markers in the
request's own text stay text: `content.py`), and its output -> reasoning, content and tool calls (`parsers.py`,
values typed by `coercion.py`)."""
