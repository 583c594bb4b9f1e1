"""The number of CPU threads a run computes with: PyTorch's, and the BLAS of SciPy's LAPACK calls.

``trainer.threads`` sets both: SLANG's update takes its top eigenpairs from LAPACK through SciPy
(:func:`bdl_bench.curvature.eigen.top_eigenpairs`), whose OpenBLAS would otherwise use every core, so a one-thread
run (bit for bit repeatable) would not be one thread. The BLAS limit goes through ``threadpoolctl`` for the libraries
loaded by then; ``bdl_bench.curvature`` loads SciPy's when it is imported.
"""

from __future__ import annotations

import torch
from threadpoolctl import threadpool_limits


def set_threads(n_threads: int) -> None:
    """Compute with ``n_threads`` threads: ``torch.set_num_threads`` and the loaded BLAS libraries' limit."""
    torch.set_num_threads(n_threads)
    threadpool_limits(limits=n_threads, user_api="blas")
