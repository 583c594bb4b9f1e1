"""bdl-bench: reproduce and extend benchmarks of Bayesian deep learning papers."""

from bdl_bench import resolvers as _resolvers  # noqa: F401  (registers the configs' OmegaConf resolvers)

__version__ = "0.1.0"
