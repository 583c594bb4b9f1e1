"""Hand-written ``torch.autograd.Function``s of the training steps: fused forwards with custom backwards.

Each module holds one family of kernels; ``tests/kernels`` compares every kernel with its plain-autograd twin
(value and gradients, float64): ``*_reference`` in ``tests/_kernel_references.py``, or beside the kernel where
evaluation runs it too (ELRG's :func:`~bdl_bench.kernels.elrg_terms.low_rank_local_linear_reference`).
"""
