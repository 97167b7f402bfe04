import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models gain nothing from intra-op threads, and OpenMP spinning makes them crawl when another process
# (a benchmark, a second pytest) holds the cores. Tests on the real model set their own thread count.
torch.set_num_threads(int(os.environ.get("TLT_TEST_THREADS", "1")))


@pytest.fixture(scope="module")
def sampling_model():
    """The small-vocabulary, sharp model of the two-sample distribution tests (trees and history)."""
    from tiny_models import tiny_model

    return tiny_model("llama", vocab_size=8, logit_scale=12.0, seed=3)
