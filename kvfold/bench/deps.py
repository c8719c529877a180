"""The third-party packages `kvfold bench` uses beyond kvfold's own dependencies: the `bench` extra
(`pip install 'kvfold[bench]'`).

* transformers: `--vs transformers` (its cells and the sanity cell load `DeepseekV4ForCausalLM`),
  and llama.cpp's `convert_hf_to_gguf.py`, which `--vs llama.cpp` runs with this Python;
* openai: `kvfold bench serve`'s client (`AsyncOpenAI`);
* pyyaml, tqdm: llama.cpp's converter and its `gguf-py` (they come with transformers, too).
* flyweight-llm: `--vs flyweight`'s `flyweight` CLI (flyweight.py finds it; a missing one makes
  its cells `unavailable`, it never stops a run). Wheels for Linux x86-64 and Windows x64 only.

`import kvfold`, `kvfold generate`, `kvfold serve` and a plain `kvfold bench` (kvfold's cells only)
need none of them. A bench command that needs a missing one stops before doing any work with
`MissingPackageError` (a KvfoldError: the CLI prints `error: ...` and exits with status 2).
Torch-free; importing this module imports none of the packages.
"""
from __future__ import annotations

import importlib.util
import sys

from ..errors import KvfoldError

EXTRA = "bench"
INSTALL_HINT = f"pip install 'kvfold[{EXTRA}]'"


class MissingPackageError(KvfoldError):
    """A bench command needs a package of the `bench` extra that is not installed."""


def available(module: str) -> bool:
    """Whether `import module` can find it (without importing it). A None entry in sys.modules,
    Python's way of blocking an import, counts as missing."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, what: str, package: str | None = None) -> None:
    """Raise MissingPackageError unless `module` is importable: "<what> needs the <package>
    package: pip install 'kvfold[bench]'"."""
    if not available(module):
        raise MissingPackageError(f"{what} needs the {package or module} package: {INSTALL_HINT}")
