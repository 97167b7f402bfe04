import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models gain nothing from intra-op threads, and OpenMP spinning makes them crawl when another process
# (a benchmark, a second pytest) holds the cores. Tests on the real model set their own thread count.
torch.set_num_threads(int(os.environ.get("TLT_TEST_THREADS", "1")))
