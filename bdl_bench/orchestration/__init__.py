"""Running experiments: the command line, runs, sweeps, searches and reproductions of paper tables.

The rest of the package (methods, models, data, curvature, report, ...) never imports these modules.

- ``cli``: the ``bdl-bench`` entry point; routes the subcommands.
- ``hydra_app``: the Hydra application behind ``run`` and ``reproduce`` (config folder, groups, one job).
- ``runner``: one run: config to data, model, method, fit, evaluation and results folder.
- ``evaluation``: a fitted method's test and OOD metrics, ELBO and history rows.
- ``stacked``: one job fitting a method on several data splits at once.
- ``search``: hyperparameter search as stacked replicas.
- ``sweep``: sweep members (skip finished, resume, record failures) and sweep summaries.
- ``resume``: a job's checkpoint: what it holds, which one to resume from, restoring it.
- ``reproduce``: ``bdl-bench reproduce <experiment>``: run a paper's sweep and compare with the paper.
- ``benchmark``: ``reproduce`` of an experiment that times training steps instead of training.
- ``devices``: ``trainer.device``/``dtype`` resolved, the device record, determinism.
- ``threads``: the torch and BLAS threads a run computes with.
- ``allocator``: glibc ``malloc`` settings that keep freed tensor memory in the process.
- ``locking``: one writer per run folder (lock files with heartbeats).
- ``sigterm``: SIGTERM handled like Ctrl-C, at an epoch's end.
- ``write_errors``: failed writes into a results folder as one-line user errors.
- ``status``: ``bdl-bench status``: what the runs below a folder are doing.
- ``catalogue``: ``bdl-bench list`` and ``--version``.
"""
