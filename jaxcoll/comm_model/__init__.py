"""Communication model: topologies, the cost of each collective, tuning tables.

Layer: above :mod:`jaxcoll.collectives` (whose ``auto`` choice reads the cost
model and tuning tables on first use), below the trainers and the scale model.

- :mod:`~jaxcoll.comm_model.topology`: ``Topology`` (levels of latency and
  bandwidth), presets of real machines, built from a mesh.
- :mod:`~jaxcoll.comm_model.cost`: alpha-beta(-gamma) cost of every
  (collective, algorithm), cited.
- :mod:`~jaxcoll.comm_model.collective_sim`: step-by-step simulation of the
  ppermute schedules on a topology.
- :mod:`~jaxcoll.comm_model.tuning`: measured tuning tables (JSON, shipped in
  ``tuning_tables/``) used by ``algorithm="auto"``.
"""
