"""Hand-written ``torch.autograd.Function``s of the training steps: fused forwards with custom backwards.

Each module holds one family of kernels beside a plain-autograd reference (``*_reference``), which
``tests/kernels`` compares every kernel against (value and gradients, float64).
"""
