"""An engine runs its own batch-invariant mode and never changes the model object it was handed:
engines and other holders of one model keep their own numerics (issue: the engine used to switch
the model's mode for everyone)."""
import pytest

from kvfold import Engine, SamplingParams
from kvfold.errors import ConfigError
from kvfold.models.base import CausalLM
from kvfold.numerics import native

from helpers import random_ids


@pytest.fixture
def modes_seen(monkeypatch):
    """The batch-invariant mode every model call ran in, in order."""
    seen = []
    run_rows = CausalLM._forward_rows

    def spy(self, pieces, last_only, invariant=None, **kw):
        out = run_rows(self, pieces, last_only, invariant, **kw)
        seen.append(self._last_mode)
        return out

    def run(self, batch, last_only):
        self._last_mode = batch.ops.batch_invariant  # the Backend the call was handed
        return type(self)._run_rows_real(self, batch, last_only)

    monkeypatch.setattr(CausalLM, "_forward_rows", spy)
    return seen, run


def test_two_engines_over_one_model_each_run_their_own_mode_and_leave_the_models(tiny, monkeypatch, modes_seen):
    seen, run = modes_seen
    cls = type(tiny)
    monkeypatch.setattr(cls, "_run_rows_real", cls._run_rows, raising=False)
    monkeypatch.setattr(cls, "_run_rows", run)
    before = tiny.batch_invariant
    assert before == native.available()  # an fp32 CPU model starts in the mode where native.c holds it
    torch_rows = Engine(tiny, max_seq_len=128, batch_invariant=False)
    fixed_rows = Engine(tiny, max_seq_len=128, batch_invariant=before)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = random_ids(9, tiny.config.vocab_size, seed=1).tolist()
    for engine, mode in ((torch_rows, False), (fixed_rows, before), (torch_rows, False)):
        seen.clear()
        engine.generate([prompt], sp)
        assert seen and all(m == mode for m in seen), (mode, seen)
        assert tiny.batch_invariant == before
    seen.clear()
    tiny.forward(prompt, tiny.new_state(capacity=16))  # the model's own calls keep the model's mode
    assert seen == [before]


def test_an_engine_refused_its_mode_leaves_the_model_as_it_was(tiny):
    bf16 = type(tiny)(tiny.config, dtype=__import__("torch").bfloat16)
    assert not bf16.batch_invariant
    with pytest.raises(ConfigError, match="batch-invariant mode runs fp32"):
        Engine(bf16, max_seq_len=64, batch_invariant=True)
    assert not bf16.batch_invariant
    with pytest.raises(ConfigError, match="batch-invariant mode runs fp32"):
        bf16.forward_batch([([1, 2], bf16.new_state(capacity=8))], batch_invariant=True)
