import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter; this must be set before triton is
# imported anywhere in the test session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# one torch thread a pytest-xdist worker (the workers share the cores), else up to two
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
