"""Input data: synthetic sets, file sources, per-process sharding of the batch.

Layer: uses ``checks`` and JAX only; the runner (:mod:`jaxcoll.run`) builds its
input pipeline from these pieces.

- :mod:`jaxcoll.data.synthetic`: learnable synthetic data sets, each a pure
  function of ``(seed, step, global_batch_size)``.
- :mod:`jaxcoll.data.sharding`: which rows of the global batch a process feeds,
  and the global ``jax.Array`` built from each process's rows.
- :mod:`jaxcoll.data.sources`: Parquet / ArrayRecord sources read with grain,
  each process reading only its own part.
- :mod:`jaxcoll.data.files`: writing shards (``experiments.make_shards``).
- :mod:`jaxcoll.data.convert`: the user's .npz / CSV / JSON Lines / Parquet files
  read a chunk at a time (``experiments.make_shards --input``).

The names of the synthetic sets and of the sharding helpers are re-exported
here (``jaxcoll.data.TeacherMLPData``, ``jaxcoll.data.global_batch``).
"""

from jaxcoll.data.sharding import from_process_local as from_process_local
from jaxcoll.data.sharding import global_batch as global_batch
from jaxcoll.data.sharding import process_batch_slice as process_batch_slice
from jaxcoll.data.synthetic import MASK_TOKEN as MASK_TOKEN
from jaxcoll.data.synthetic import Batch as Batch
from jaxcoll.data.synthetic import ClickData as ClickData
from jaxcoll.data.synthetic import SyntheticDataset as SyntheticDataset
from jaxcoll.data.synthetic import TeacherImageData as TeacherImageData
from jaxcoll.data.synthetic import TeacherMLPData as TeacherMLPData
from jaxcoll.data.synthetic import TokenData as TokenData
from jaxcoll.data.synthetic import normal as normal
from jaxcoll.data.synthetic import uniform as uniform
