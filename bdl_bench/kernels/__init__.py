"""Hand-written ``torch.autograd.Function``s of the training steps: fused forwards with custom backwards.

Each module holds one family of kernels beside a plain-autograd reference (a short function computing the
same value with ordinary torch ops), which ``tests/kernels`` compares every kernel against (value and
gradients, float64). The methods import their kernels from here:

* :mod:`~bdl_bench.kernels.buffers`: reused gradient buffers (layer-wise VI).
* :mod:`~bdl_bench.kernels.diag_vi`: the closed-form KL of a diagonal Gaussian and its prior term (``ktied``).
* :mod:`~bdl_bench.kernels.mean_field`: GMFVI's softplus variance and KL in one fused backward.
* :mod:`~bdl_bench.kernels.local_reparam`: a dense layer's locally reparameterised output (``gmfvi``, ``bbb``).
* :mod:`~bdl_bench.kernels.elrg_kl` and :mod:`~bdl_bench.kernels.elrg_terms`: ELRG's low-rank KL
  (Lemma 2), its fused step terms and its layers' sample (Lemma 1).
"""
