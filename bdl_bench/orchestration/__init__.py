"""Running experiments: the command line (``cli``, ``hydra_app``), one run (``runner``, ``evaluation``), stacked
jobs and searches (``stacked``, ``search``), sweeps (``sweep``, ``resume``, ``locking``, ``status``) and paper
reproductions (``reproduce``, ``benchmark``). The rest of the package never imports these modules.
"""
