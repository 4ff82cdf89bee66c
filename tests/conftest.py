import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _quiet_transformers_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="transformers")
        yield
