"""Starting the processes of a run: one module per way to launch, on a small shared base.

Ways to launch (each answers one hook of :mod:`polyparallel_torch.plugin`):

- :mod:`.multiprocess`: function mode, ``polyparallel.launch(fn, strategy, nprocs)``: ``nprocs``
  processes started by ``torch.multiprocessing`` on this machine, supervised by the caller.
- :mod:`.torchrun`: script mode, ``polyparallel launch SCRIPT``: the script handed to
  ``torch.distributed.run`` (the elastic agent torchrun uses: multi-node rendezvous, restarts);
  each worker runs it through :mod:`.script_worker`.

What they share:

- :mod:`.base`: a free port for a local rendezvous, the environment that tells a worker its rank,
  a worker's signals (SIGTERM raises :class:`~.base.Stopped`; the parent-death signal), atomic
  file writes.
- :mod:`.records`: the failure record a failed worker leaves for its launcher (one format, every
  way to launch); :mod:`.root_cause`: the one function that chooses, from the records and the
  exit codes, the rank to report, and writes the report.

Function mode's own parts: :mod:`.supervise` (the caller's wait, grace period and stop),
:mod:`.teardown` (how a worker ends, whatever the outcome), :mod:`.launch_dir` (the directory the
outcomes are saved in).

Importing this package imports no torch.
"""
