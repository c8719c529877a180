import pytest

import kvfold


@pytest.fixture(scope="session")
def tiny():
    """The built-in tiny model (fp32, CPU)."""
    return kvfold.load_model("tiny")
