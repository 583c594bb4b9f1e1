"""bdl-bench: reproduce and extend benchmarks of Bayesian deep learning papers."""

__version__ = "0.1.0"
