"""Where the program runs: emulated CPU devices, meshes, multi-process jobs.

Layer: the bottom (JAX only); everything else may use it.

- :mod:`~jaxcoll.runtime.devices`: the CPU simulation mode and mesh helpers
  (flat and node x local); also ``jaxcoll.devices``.
- :mod:`~jaxcoll.runtime.distributed`: ``jax.distributed`` initialisation and
  cluster detection (the launcher, Open MPI, Slurm).
- :mod:`~jaxcoll.runtime.liveness`: the survivors of a process that dies end
  at once (one line, exit 76), however the job was started.
- :mod:`~jaxcoll.runtime.launch`: ``python -m jaxcoll.launch``, local
  multi-process jobs.
"""
