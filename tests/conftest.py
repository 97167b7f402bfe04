import os
import sys
from pathlib import Path

# Without CUDA, Triton kernels run in Triton's interpreter (tests/test_kernels_triton.py). Triton reads the flag
# when it is first imported (its own tl.* helpers are compiled or interpreted then), so it is set before anything
# imports it; vLLM's CPU backend does not run Triton kernels, so its tests are unaffected.
if os.environ.get("TRITON_INTERPRET") is None and "triton" not in sys.modules:
    import torch.cuda

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models gain nothing from intra-op threads, and OpenMP spinning makes them crawl when another process
# (a benchmark, a second pytest) holds the cores. Tests on the real model set their own thread count.
torch.set_num_threads(int(os.environ.get("TLT_TEST_THREADS", "1")))


@pytest.fixture(scope="module")
def sampling_model():
    """The small-vocabulary, sharp model of the two-sample distribution tests (trees and history)."""
    from tiny_models import tiny_model

    return tiny_model("llama", vocab_size=8, logit_scale=12.0, seed=3)
