"""Running experiments: the command line (``cli``, ``hydra_app``), one run (``runner``, ``evaluation``), stacked
jobs and searches (``stacked``, ``search``), sweeps (``sweep``, ``resume``, ``locking``, ``status``) and paper
reproductions (``reproduce``, ``benchmark``). Of the rest of the package only ``studies`` (which run experiments)
imports these modules; the methods, data, models and maths never do.
"""
