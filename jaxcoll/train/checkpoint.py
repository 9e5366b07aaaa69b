"""Checkpoints that restore onto any strategy, device count or process count.

A :class:`Checkpointer` saves the trainer's *canonical* state
(:meth:`jaxcoll.Trainer.export_state`: full parameters and the optimizer
state ``optimizer.init(params)`` would have on one device) with orbax's
``CheckpointManager``, so a run saved as ZeRO-3 on 8 devices resumes as data
parallel on 4, on one process or several. Next to the state it keeps the data
position (the index of the next batch: jaxcoll's data sets are pure
functions of the step) and a JSON ``extra`` (e.g. the config).

With compressed data parallelism and error feedback, the quantization
residuals (each device's rows, ``P(data axes)``; each process writes its
own) are saved as an optional ``residual`` item, not part of the canonical
state, with the layout they belong to (:meth:`jaxcoll.Trainer.residual_layout`:
strategy, compression, data-parallel size, bucket plan). A restore onto an
equal layout and residual shapes gets them back, so a plain resume continues
bit-identically; onto another layout, or from a checkpoint without them
(older ones), they restart at zero with one warning saying why.

On disk, one directory per step::

  DIR/<step>/state/...    the canonical state (orbax StandardSave, OCDBT)
  DIR/<step>/residual/... error-feedback residuals (only with them)
  DIR/<step>/meta/...     JSON: data_position, extra, every leaf's path,
                          shape, dtype and a fingerprint of its bytes (the
                          residuals' under ``residual``, with their
                          ``layout``), and the sha256 of the JSON itself
  DIR/<step>/commit_success.txt

Atomicity comes from orbax: a save writes ``DIR/<step>.orbax-checkpoint-tmp``
and, once every file (and, with several processes, every process) is done,
writes ``commit_success.txt`` into it and renames it to ``DIR/<step>``. A
process killed mid-save leaves only the tmp directory, which is never read
(and is removed when the next :class:`Checkpointer` opens ``DIR``).
Restoring checks more than orbax does: a step directory without the commit
marker, with unreadable files or whose arrays do not match the fingerprints
written at save time is skipped with a warning, and the previous step is
used; a checkpoint is never loaded half. A state with a NaN or infinity is
never written (:class:`NonFiniteStateError`), and ``keep`` counts only
committed steps, so a stray or partial step directory never displaces a good
checkpoint.

Example:
  >>> ckpt = jaxcoll.checkpoint.Checkpointer(workdir + "/checkpoints")  # doctest: +SKIP
  >>> state = trainer.init(params)  # doctest: +SKIP
  >>> if ckpt.latest_step() is not None:  # doctest: +SKIP
  ...   state, position, extra = ckpt.restore(trainer)
  >>> ckpt.save(int(state.step), trainer, state, data_position=position)  # doctest: +SKIP
  >>> ckpt.close()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging as std_logging
import math
import os
import shutil
import sys
import threading
import time
import uuid
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from jaxcoll import checks, disk
from jaxcoll import fingerprint as fingerprint_lib
from jaxcoll.disk import COMMIT_SUCCESS_FILE as COMMIT_SUCCESS_FILE  # the listing: a leaf, so
from jaxcoll.disk import step_dirs as step_dirs  # the run report reads it below this layer
from jaxcoll.disk import unfinished_saves as unfinished_saves
from jaxcoll.errors import CheckpointSaveError as CheckpointSaveError
from jaxcoll.errors import CorruptCheckpointWarning as CorruptCheckpointWarning
from jaxcoll.errors import NonFiniteStateError as NonFiniteStateError
from jaxcoll.train import canonical as canonical_lib

FORMAT_VERSION = 2  # 2: the metadata carries its own sha256
_META_CHECKSUM = "sha256"
_STATE, _META, _RESIDUAL = "state", "meta", "residual"
# Array bytes orbax writes or reads at once per process (raised to fit the
# largest shard): bounds the host buffers of a save or restore to about one
# leaf instead of the whole state (orbax's own default is 96 GB).
DEFAULT_BYTES_IN_FLIGHT = 64 * 2**20


_QUIETED = False
# Orbax's modules whose ERROR logs echo a failure of an asynchronous save,
# which orbax also re-raises from wait_until_finished (Checkpointer names it).
_ORBAX_SAVE_THREADS = frozenset({"async_checkpointer.py", "future.py", "checkpoint_manager.py"})
_ORBAX_FAILED = threading.Event()  # a save ran out of space: orbax's late errors are its echoes


def _join_orbax_threads(timeout_s: float) -> None:
  """Waits (at most ``timeout_s`` in all) for orbax's background save
  threads still running after a failed save (orbax's ``wait_until_finished``
  raises at the first failure, while the save's other threads go on)."""
  try:
    from orbax.checkpoint._src.futures import future as orbax_future  # noqa: PLC0415
    kinds = (orbax_future._SignalingThread,)  # noqa: SLF001  (no public handle on them)
  except (ImportError, AttributeError):  # pragma: no cover - another orbax layout
    return
  deadline = time.monotonic() + timeout_s
  for thread in threading.enumerate():
    if isinstance(thread, kinds) and thread is not threading.current_thread():
      thread.join(max(0.0, deadline - time.monotonic()))


def _quiet_orbax_disk_full() -> None:
  """Once per process: a failed orbax save is reported once, by
  :class:`jaxcoll.disk.DiskFullError` (the command line's one line, exit
  74) or :class:`CheckpointSaveError`, not also as orbax's ERROR log of
  every background thread it failed in (each with a traceback), nor as the
  ``Event loop is closed`` errors of
  the tensorstore writes still pending when orbax's event loop closed after
  the first failure (printed through ``sys.unraisablehook``). Other errors
  and logs pass unchanged."""
  global _QUIETED
  if _QUIETED:
    return
  _QUIETED = True

  def orbax_disk_full(record) -> bool:
    if "orbax" not in record.pathname.replace("\\", "/").split("/"):
      return True
    if record.levelno >= std_logging.ERROR and record.filename in _ORBAX_SAVE_THREADS:
      return False  # a failed save: re-raised by wait_until_finished, named by Checkpointer
    if _ORBAX_FAILED.is_set() and record.levelno >= std_logging.ERROR:
      return False  # after the full disk was reported: the failing save's other threads
    error = record.exc_info[1] if record.exc_info else None
    return not (disk.is_full(error) or disk.is_full(RuntimeError(record.getMessage())))

  std_logging.getLogger("absl").addFilter(orbax_disk_full)
  previous = sys.unraisablehook

  def unraisable(info) -> None:
    e, tb = info.exc_value, info.exc_traceback
    while tb is not None and tb.tb_next is not None:
      tb = tb.tb_next
    if (isinstance(e, RuntimeError) and str(e) == "Event loop is closed" and tb is not None
        and tb.tb_frame.f_code.co_name == "_check_closed"):
      return
    previous(info)

  sys.unraisablehook = unraisable


def check_glob_free(directory) -> None:
  """Refuses a directory whose path holds a glob's special character: orbax finds each
  process's OCDBT files to merge (and its array metadata) by a glob of the path. A ``[``
  (a character class) matches nothing there, so every save committed without its arrays'
  manifest and read back as damaged (tensorstore NOT_FOUND ``.zarray``); a ``*`` or ``?``
  also matches other directories, a sweep's sibling runs (``run?`` and ``run1``), whose
  files a save of the same step at the same time merged (it failed, NotImplementedError:
  CopyRange not supported, and the run with it). The runner calls it before it creates the
  workdir; a :class:`Checkpointer` calls it before it creates ``directory``.

  Raises:
    ValueError: the path holds ``[``, ``*`` or ``?``; the message says why and the fix.
  """
  path = os.path.abspath(os.fspath(directory))
  if "[" in path:
    raise ValueError(
        f"checkpoint directory {path!r} contains '[': orbax finds the files of a save by a "
        "glob of this path, which a '[' breaks, so its checkpoints could not be read back "
        "(each skipped as damaged); use a directory (--workdir) without '['."
    )
  wild = next((c for c in "*?" if c in path), None)
  if wild is not None:
    raise ValueError(
        f"checkpoint directory {path!r} contains {wild!r}: orbax finds the files of a save "
        f"by a glob of this path, and there {wild!r} also matches other directories (a "
        "sweep's sibling runs), whose files a save of the same step at the same time takes "
        "in (the save fails, and the run with it); use a directory (--workdir) without '*' "
        "or '?' (an existing one can be renamed: its checkpoints move with it)."
    )


class Checkpointer:
  """Saves and restores a :class:`jaxcoll.Trainer`'s state in a directory.

  Every process of a multi-process job must make the same calls (orbax
  coordinates them; replicated arrays are written once).

  Args:
    directory: where the step directories go; created if missing.
    keep: how many of the newest checkpoints to keep (older ones are
      deleted after each save), or None to keep all.
    async_save: write in a background thread: ``save`` returns once the
      arrays are copied to host memory. Call :meth:`wait` (or
      :meth:`close`) before reading the files or exiting.
    read_only: only read (``metadata``, ``restore``): nothing in
      ``directory`` is created, probed, pruned or written, so its files and
      their mtimes stay as they are; ``save`` raises.
    bytes_in_flight: at most this many bytes of array data are being written
      or read at once per process (orbax's ``save_concurrent_gb`` /
      ``restore_concurrent_gb``), raised to twice the largest shard if that
      is more, so a save or restore buffers about one leaf, not the state.

  Raises:
    ValueError: ``directory`` cannot be created or written or holds ``[``, ``keep`` is
      not a positive int or None, or ``bytes_in_flight`` not a positive int.
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    keep: int | None = 3,
    async_save: bool = True,
    read_only: bool = False,
    bytes_in_flight: int = DEFAULT_BYTES_IN_FLIGHT,
  ):
    if keep is not None:
      checks.positive_int(keep, "keep", fix="It counts the checkpoints to keep (None keeps "
                          "all); the default is 3.")
    self.bytes_in_flight = checks.positive_int(
      bytes_in_flight, "bytes_in_flight",
      fix=f"It caps the array bytes written or read at once (default {DEFAULT_BYTES_IN_FLIGHT}).")
    self.read_only = bool(read_only)
    check_glob_free(directory)
    _quiet_orbax_disk_full()
    self.directory = (os.path.abspath(os.fspath(directory)) if read_only
                      else check_writable(directory))
    self.keep = None if read_only else keep
    self.async_save = async_save
    self._limit = self.bytes_in_flight
    if not self.read_only:
      _refuse_foreign_steps(self.directory)
    self._manager = self._open(cleanup=True)
    if not self.read_only and jax.process_index() == 0:
      _finish_deletions(self.directory)
    self._checks = _LeafChecks()
    self._in_flight: int | None = None  # the step of the save not yet committed
    self._pins: tuple = ()  # host views of the buffers of the save in flight (_pin)
    self._failed = False  # a save ran out of space: nothing more is saved
    self._damaged: set[int] = set()  # committed steps restore found damaged
    self._kept_foreign: set[int] = set()  # old steps kept: they hold the user's files

  def _open(self, *, cleanup: bool) -> ocp.CheckpointManager:
    """An orbax manager whose state item moves at most ``self._limit`` bytes at once."""
    options = ocp.CheckpointManagerOptions(
      # `keep` is applied here (_prune), counting committed steps only: orbax
      # would count any numbered directory, a stray empty one included.
      preservation_policy=ocp.checkpoint_managers.LatestN(n=None),
      enable_async_checkpointing=self.async_save,
      create=not self.read_only,
      cleanup_tmp_directories=cleanup and not self.read_only,
    )
    gb = self._limit / 10**9  # orbax counts in (decimal) GB
    handlers = {
      _STATE: ocp.StandardCheckpointHandler(save_concurrent_gb=gb, restore_concurrent_gb=gb),
      _META: ocp.JsonCheckpointHandler(),
      _RESIDUAL: ocp.StandardCheckpointHandler(save_concurrent_gb=gb, restore_concurrent_gb=gb),
    }
    return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def _fit_limit(self, like) -> None:
    """Raises the in-flight cap to fit the largest shard (orbax moves a shard whole).

    Call with nothing in flight (after :meth:`wait`); every process computes
    the same cap from the same shapes, so all reopen together.
    """
    shards = [
      math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
      if getattr(x, "sharding", None) is not None else x.size * np.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(like)
    ]
    # Reads may hold a shard twice (stored and cast), hence the factor 2.
    limit = max(self.bytes_in_flight, 2 * max(shards, default=0) + 1)
    if limit != self._limit:
      self._manager.close()
      self._limit = limit
      self._manager = self._open(cleanup=False)

  # -- saving ------------------------------------------------------------------

  def save(self, step: int, trainer, state, *, data_position: int, extra: Any = None) -> None:
    """Saves ``trainer.export_state(state)`` as checkpoint ``step``, and
    ``state.residual`` with its ``trainer.residual_layout()`` when the trainer
    has error-feedback residuals (saved from the state's own buffers: no copy).

    Returns as soon as the arrays are on the host (with ``async_save``);
    ``state`` may be donated to the next step right away. The previous
    asynchronous save, if still running, is waited for first.

    Args:
      step: the checkpoint's number, usually ``int(state.step)``.
      trainer: the :class:`jaxcoll.Trainer` that owns ``state``.
      state: its ``TrainState``.
      data_position: the index of the next batch to train on.
      extra: anything JSON can encode (a dict, e.g. the config; an
        ``ml_collections.ConfigDict`` is saved as its ``to_dict()``).

    Raises:
      ValueError: a bad ``step`` or ``data_position``, an ``extra`` JSON
        cannot encode, or ``step`` is already saved.
      NonFiniteStateError: a floating-point leaf (residuals included) holds
        NaN or infinity; nothing is written and no older checkpoint is pruned.
    """
    if self.read_only:
      raise ValueError(f"this Checkpointer of {self.directory} is read-only (`read_only`=True); "
                       "open it with read_only=False to save.")
    if self._failed:
      raise disk.DiskFullError(f"disk full: an earlier save to {self.directory} ran out of "
                               "space; open a new Checkpointer once there is room.")
    step = _check_index(step, "step")
    data_position = _check_index(data_position, "data_position")
    if hasattr(extra, "to_dict"):
      extra = extra.to_dict()
    try:
      extra = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
      raise ValueError(
        f"`extra` must be JSON-encodable (dicts, lists, str, numbers, bool, None); "
        f"{e}. Convert it, e.g. extra=config.to_dict()."
      ) from None
    self.wait()  # also prunes to `keep` now that the previous save is committed
    self._recreate_if_removed()
    self._clear_damaged(step)
    if step in self._manager.all_steps():
      raise ValueError(
        f"`step` {step} is already saved in {self.directory}; save a new step or "
        "delete that directory first."
      )
    layout = _residual_layout(trainer)
    residual = _residual_item(state.residual) if layout is not None else None
    if not jax.tree.leaves(residual):
      residual = None
    self._fit_limit((trainer.export_shapes(), residual))
    canonical = _export(trainer, state)
    leaves = jax.tree.leaves(canonical)
    specs = canonical_lib.leaf_specs(canonical)
    prints, finite = self._checks(leaves)
    res_leaves = jax.tree.leaves(residual)
    res_specs = canonical_lib.leaf_specs(residual) if residual is not None else {}
    res_prints, res_finite = self._checks(res_leaves)
    if not all(finite) or not all(res_finite):
      bad = [path for path, ok in zip(specs, finite) if not ok]
      bad += [f"residual/{path}" for path, ok in zip(res_specs, res_finite) if not ok]
      raise NonFiniteStateError(
        f"the state of step {step} is not finite (NaN or infinity in {bad[:4]}"
        f"{' and more' if len(bad) > 4 else ''}); checkpoint {step} is not written and the "
        "existing ones are kept. Lower the learning rate, clip gradients, or set "
        "nan_policy='skip'."
      )
    meta = {
      "format": FORMAT_VERSION,
      "step": step,
      "data_position": data_position,
      "extra": extra,
      "leaves": [
        {"path": path, "shape": list(shape), "dtype": dtype, "fingerprint": int(f)}
        for (path, (shape, dtype)), f in zip(specs.items(), prints)
      ],
      # The containers the leaves' paths do not name (optax's EmptyState()): restore
      # compares them before orbax reads anything, so another optimizer of the same
      # leaves (adam saved, adamw restoring) is a mismatch, never taken for damage.
      "empty_containers": canonical_lib.empty_containers(canonical),
      **({} if residual is None else {"residual": {
        "layout": layout,
        "leaves": [
          {"path": path, "shape": list(shape), "dtype": dtype, "fingerprint": int(f)}
          for (path, (shape, dtype)), f in zip(res_specs.items(), res_prints)
        ],
      }}),
      "saved_by": {
        "strategy": trainer.strategy.name,
        "data_parallel_size": trainer.dp_size,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "jax": jax.__version__,
        "time": time.time(),
      },
    }
    meta[_META_CHECKSUM] = _json_sha256(meta)
    self._in_flight = step
    # Until the save is committed: host views of every buffer written (zero-copy on
    # XLA:CPU, where the canonical leaves may be the state's own buffers). A donated
    # step cannot reuse a buffer numpy still views, so it computes into new ones and
    # what is written stays the state of `step`, whatever orbax copies or not.
    # The residuals are the state's own buffers (no copy), pinned as well.
    self._pins = _pin(leaves + res_leaves)
    items = {_STATE: ocp.args.StandardSave(_without_empty(canonical)),
             _META: ocp.args.JsonSave(meta)}
    if residual is not None:
      items[_RESIDUAL] = ocp.args.StandardSave(_without_empty(residual))
    try:
      self._manager.save(
        step,
        args=ocp.args.Composite(**items),
        force=True,
      )
    except Exception as e:  # noqa: BLE001  (named: _raise_save_failure)
      self._raise_save_failure(e)
    if not self.async_save:
      self._in_flight = None
      self._pins = ()

  def wait(self, *, prune: bool = True) -> None:
    """Blocks until the asynchronous save in flight (if any) is committed,
    then (``prune``) deletes the committed steps older than the newest ``keep``.

    Raises:
      jaxcoll.disk.DiskFullError: the save in flight found no space left;
        that step is not committed (never restored), the older ones are kept.
    """
    if self._failed:  # a save ran out of space; orbax's manager is closed
      return
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001  (named: _raise_save_failure)
      self._raise_save_failure(e)
    self._in_flight = None
    self._pins = ()
    if prune:
      self._prune()

  def _raise_save_failure(self, error: BaseException) -> None:
    """A failed orbax save becomes one named error: a full disk (tensorstore's
    ``RESOURCE_EXHAUSTED``, several exceptions deep) a
    :class:`jaxcoll.disk.DiskFullError`, anything else a
    :class:`CheckpointSaveError` (both from None: the one line says it all).
    Orbax's other background threads of that save may still run: they are
    let end now (not at interpreter shutdown, with a traceback each), and
    this Checkpointer saves nothing more."""
    step, self._in_flight = self._in_flight, None
    self._pins = ()
    self._failed = True
    _ORBAX_FAILED.set()
    _join_orbax_threads(timeout_s=30.0)
    with contextlib.suppress(Exception):
      self._manager.close()
    try:
      kept = self.all_steps()
    except OSError:
      kept = []
    intact = (f"the committed ones ({kept}) are intact" if kept
              else "the directory holds no committed one")
    if disk.is_full(error):
      raise disk.DiskFullError(
        f"disk full: no space left on the device of {self.directory} while saving checkpoint "
        f"{step}; that checkpoint is not committed (never restored) and {intact}. Free space "
        "or use another --workdir; a rerun resumes from the newest committed step."
      ) from None
    first = (str(error).strip().splitlines() or [""])[0][:400]
    raise CheckpointSaveError(
      f"saving checkpoint {step} in {self.directory} failed ({type(error).__name__}: {first}); "
      f"that checkpoint is not committed (never restored) and {intact}. A rerun resumes from "
      "the newest committed step."
    ) from None

  def _recreate_if_removed(self) -> None:
    """``directory`` removed while the run went on (e.g. ``rm -rf``): made
    again with a warning, so the next checkpoint is saved (the removed ones
    are gone). Process 0 decides and creates; all reload their view."""
    if "://" in str(self.directory):
      return
    missing = not os.path.isdir(str(self.directory))
    if jax.process_count() > 1:
      missing = bool(multihost_utils.broadcast_one_to_all(np.int32(missing)))
    if not missing:
      return
    if jax.process_index() == 0:
      warnings.warn(
        f"the checkpoint directory {self.directory} was removed while the run went on; "
        "making it again (the checkpoints it held are gone).",
        CorruptCheckpointWarning,
        stacklevel=3,
      )
      os.makedirs(str(self.directory), exist_ok=True)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("jaxcoll_checkpoint_recreate")
    self._manager.reload()

  def close(self, *, failed: bool = False) -> None:
    """Waits for the save in flight and releases orbax's resources.

    ``failed``: on the way out of an error (``__exit__`` with an exception)
    the old steps are not pruned: pruning agrees with the other processes in
    a collective, and a process that failed alone (a data error the others
    did not have) would wait there for peers that never come. The next
    run's first save prunes them (more than ``keep`` stay on disk until
    then; none is lost)."""
    self.wait(prune=not failed)
    if not self._failed:
      self._manager.close()

  def _prune(self) -> None:
    """Deletes committed steps beyond the newest ``keep`` committed ones.

    Uncommitted or stray directories are not counted (nor deleted), so they
    never take the place of a good checkpoint. Every process calls it, with
    no save in flight. Process 0 alone lists, decides and deletes (each step
    renamed away first, so no process ever lists a half-deleted step); the
    others wait for it in one collective and then reload their view of the
    steps. (Orbax's own ``delete`` holds a barrier that only the processes
    that still see the step enter: with every process listing the directory
    itself, one that listed after process 0's delete skipped the barrier and
    the job deadlocked.)
    """
    if self.keep is None:
      return
    deleted, failed = 0, 0
    if jax.process_index() == 0:
      for s in self.all_steps()[: -self.keep]:
        foreign = _foreign_entries(os.path.join(str(self.directory), str(s)), s)
        if foreign:  # the user's files, put there during the run: never deleted
          if s in self._kept_foreign:
            continue
          self._kept_foreign.add(s)
          failed += 1
          warnings.warn(
            f"not deleting the old checkpoint {self.directory}/{s}: it holds "
            f"{', '.join(foreign[:3])}, which jaxcoll did not write; it is kept (more than "
            f"`keep`={self.keep} on disk). Move it out of {self.directory}.",
            stacklevel=3,
          )
          continue
        try:
          _remove_step_dir(self.directory, s)
          deleted += 1
        except OSError as e:
          failed += 1
          warnings.warn(
            f"could not delete the old checkpoint {self.directory}/{s} "
            f"({e.strerror or e}); it is kept (more than `keep`={self.keep} on disk).",
            stacklevel=3,
          )
    if jax.process_count() > 1:  # also the barrier: process 0 is done deleting
      deleted, failed = (int(v) for v in multihost_utils.broadcast_one_to_all(
        np.asarray([deleted, failed], np.int32)))
    if deleted or failed:
      self._manager.reload()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    self.close(failed=exc_type is not None)  # no collective on an error's way out

  # -- finding and restoring ---------------------------------------------------

  def all_steps(self) -> list[int]:
    """Committed steps on disk, oldest first (a save in flight is not one)."""
    return [s for s, committed in self._step_dirs() if committed]

  def latest_step(self) -> int | None:
    """The newest committed step, or None if there is none.

    :meth:`restore` falls back to an older step if this one turns out to be
    damaged.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def metadata(self, step: int) -> dict[str, Any]:
    """The JSON saved next to the state of ``step`` (``data_position``,
    ``extra``, the leaves and ``saved_by``), checked against its sha256.

    Raises:
      ValueError: ``step`` is not committed, or its metadata is damaged.
    """
    step = _check_index(step, "step")
    if step not in self.all_steps():
      raise ValueError(
        f"`step` {step} is not in {self.directory}; committed steps: {self.all_steps()}."
      )
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
      meta = meta[_META]
      _check_meta_checksum(meta)
    except _OtherFormat as e:
      raise ValueError(
        f"checkpoint {self.directory}/{step} was written by another version of jaxcoll "
        f"(checkpoint {e}); read it with the version that wrote it.") from None
    except Exception as e:  # noqa: BLE001  (any failure to read means damage)
      raise ValueError(
        f"the metadata of checkpoint {self.directory}/{step} is damaged ({type(e).__name__}: {e})."
      ) from None
    return meta

  def restore(self, trainer, step: int | None = None, *,
              residual_notice=None) -> tuple[Any, int, Any]:
    """Restores a checkpoint onto ``trainer``'s mesh and strategy.

    Args:
      trainer: a :class:`jaxcoll.Trainer` whose model is known
        (``abstract_state(param_shapes)``, which allocates nothing, ``init``
        or ``import_state`` was called); any strategy, device count or process
        count.
      step: the step to restore; default: the newest one that is intact.
        Damaged or uncommitted steps are skipped with a
        :class:`CorruptCheckpointWarning` (damaged: metadata that cannot be
        read or fails its sha256, array files that cannot be read or decoded,
        bytes unlike those saved).

    Returns:
      ``(state, data_position, extra)``: a ``TrainState`` placed for
      ``trainer``, the index of the next batch, and the saved ``extra``.
      The state's error-feedback residuals are the saved ones (verified
      against their fingerprints like every leaf) when the checkpoint holds
      residuals of the trainer's ``residual_layout()`` and shapes; else
      (another device count, compression or bucket plan, or a checkpoint
      without residuals) they are zero and a ``UserWarning`` says why.
      residual_notice: called with that message (on process 0) instead of the
        ``UserWarning`` when given: the training loop makes it one log line.

    Raises:
      ValueError: the trainer has no model yet; the checkpoint's leaves do not
        match the model (each differing leaf is named with both shapes); or
        an explicitly requested ``step`` is missing or damaged.
      FileNotFoundError: no intact checkpoint in the directory.
      Exception: reading a step's arrays failed with no sign of damage (e.g.
        XLA out of memory): that error, with a note that the step is kept
        (a RuntimeError on the processes where it did not happen).
    """
    if not trainer.has_model:
      raise ValueError(
        "`trainer` has no model yet: call `trainer.abstract_state(param_shapes)` (the "
        "model's shapes, e.g. jax.eval_shape(model.init, key, x); nothing allocated) or "
        "`trainer.init(params)` before `restore`."
      )
    self.wait()
    self._manager.reload()  # steps other Checkpointers wrote meanwhile
    like = trainer.export_shapes()
    layout = _residual_layout(trainer)
    res_like = _residual_item(trainer.residual_shapes()) if layout is not None else None
    self._fit_limit((like, res_like))
    dirs = self._step_dirs()
    if step is not None:
      step = _check_index(step, "step")
      if step not in {s for s, _ in dirs}:
        raise ValueError(
          f"`step` {step} is not in {self.directory}; committed steps: {self.all_steps()}."
        )
      dirs = [(s, c) for s, c in dirs if s == step]
    for s, committed in reversed(dirs):
      if not committed:
        problem = f"it has no {COMMIT_SUCCESS_FILE} (an interrupted or partial save)"
      else:
        problem, result = self._try_restore(s, like, layout, res_like)
        where = os.path.join(str(self.directory), str(s))
        if problem is None:
          meta, canonical, residual, why = result
          if residual is None:
            state = trainer.import_state(canonical, donate=True)  # restored buffers reused
          else:
            state = trainer.import_state(
              canonical, donate=True, residual=_residual_state(residual, len(res_like)))
          if why is not None and jax.process_index() == 0:  # once per job
            message = (
              f"Checkpoint {where}: the error-feedback residuals restart at zero, because "
              f"{why}; the run continues, but not bit-identical to one that was not "
              "interrupted.")
            if residual_notice is not None:
              residual_notice(message)
            else:
              warnings.warn(message, stacklevel=2)
          return state, int(meta["data_position"]), meta.get("extra")
      where = os.path.join(str(self.directory), str(s))
      self._damaged.add(s)
      if step is not None:
        raise ValueError(f"`step` {s}: the checkpoint {where} is damaged: {problem}.")
      if jax.process_index() == 0:  # every process skips it (`_everyone`): said once per job
        warnings.warn(
          f"Skipping checkpoint {where}: {problem}. Falling back to an older step.",
          CorruptCheckpointWarning,
          stacklevel=2,
        )
    raise FileNotFoundError(
      f"No intact checkpoint in {self.directory}"
      + (f" (skipped damaged steps {[s for s, _ in dirs]})" if dirs else "")
      + "; start from `trainer.init(params)` instead."
    )

  def _try_restore(self, step: int, like, layout=None, res_like=None) -> tuple[str | None, Any]:
    """``(None, (meta, canonical, residual, why))``, or ``(why it is damaged, None)``.

    ``residual``: the saved error-feedback residuals when they fit
    ``layout`` and ``res_like`` (the restoring trainer's), else None, and
    then ``why`` says why not (None: the trainer has no residuals).
    A mismatch with the model raises instead: it is not damage, and an
    older step of the same directory would not fit either.
    """
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
      meta = meta[_META]
      _check_meta_checksum(meta)
      saved = canonical_lib.saved_specs(meta["leaves"])
      prints = [d["fingerprint"] for d in meta["leaves"]]
      saved_empty = meta.get("empty_containers")  # None: saved before it was recorded
      int(meta["data_position"])
      why = _residuals_misfit(meta.get("residual"), layout, res_like)
      use_residual = layout is not None and why is None
      res_prints = ([d["fingerprint"] for d in meta["residual"]["leaves"]]
                    if use_residual else [])
      ok = True
    except _OtherFormat as e:  # every process reads the same file: they agree
      raise ValueError(
        f"Checkpoint {self.directory}/{step} was written by another version of jaxcoll "
        f"(checkpoint {e}): it is not damaged, and it is left as it is. Restore it with the "
        "jaxcoll version that wrote it, or use another `directory`.") from None
    except Exception as e:  # noqa: BLE001  (any failure to read means damage)
      ok, problem = False, f"its metadata cannot be read ({type(e).__name__}: {e})"
    if not _everyone(ok):
      return (problem if not ok else "another process could not read its metadata"), None

    problems = canonical_lib.spec_mismatches(
      saved, canonical_lib.leaf_specs(like), ignore_dtype=True
    )
    if problems:
      raise ValueError(
        f"Checkpoint {self.directory}/{step} does not match the trainer's model "
        "(checkpoint leaf vs trainer.export_shapes()): "
        + canonical_lib.mismatches_line(problems)
        + ". Restore into a trainer built for the same model and optimizer, or use "
        "another `directory`. The checkpoint is left as it is."
      )
    if saved_empty is not None:
      differ = canonical_lib.container_mismatches(
        saved_empty, canonical_lib.empty_containers(like))
      if differ:
        raise ValueError(self._containers_line(step, "; ".join(differ[:3])))

    problem, error = None, None
    try:
      items = {_STATE: ocp.args.StandardRestore(_without_empty(like))}
      if use_residual:
        items[_RESIDUAL] = ocp.args.StandardRestore(_without_empty(res_like))
      # An item's directory deleted by hand (`rm -rf 6/state`): files gone, as a removed
      # array file is; orbax's KeyError ("Item ... was not found") said no damage. Local
      # paths only: os.path sees no gs:// directory, and every step there read as damaged.
      gone = [f"{name}/" for name in items if "://" not in str(self.directory)
              and not os.path.isdir(os.path.join(str(self.directory), str(step), name))]
      if gone:
        raise FileNotFoundError(f"its {' and '.join(gone)} directory is gone")
      both = self._manager.restore(step, args=ocp.args.Composite(**items))
      restored = _with_empty(both[_STATE], like)
      residual = _with_empty(both[_RESIDUAL], res_like) if use_residual else None
      got, _ = self._checks(jax.tree.leaves(restored))
      model = canonical_lib.leaf_specs(like)
      cast = [(name, dtype, model[name][1]) for name, (_, dtype) in saved.items()
              if dtype != model[name][1]]
      # A leaf cast to another dtype on restore has other bytes: not checked.
      recast = {name for name, _, _ in cast}
      bad = [name for name, before, after in zip(saved, prints, got)
             if before != after and name not in recast]
      if use_residual:
        res_got, _ = self._checks(jax.tree.leaves(residual))
        bad += [f"residual/{name}" for name, before, after in zip(
          canonical_lib.leaf_specs(res_like), res_prints, res_got) if before != after]
      if bad:
        problem = f"the bytes of {bad} differ from what was saved"
    # Damage is what reading or decoding the files says (tensorstore's errors and a JSON
    # that does not parse are ValueErrors, a file gone an OSError) or bytes unlike those
    # saved; anything else (XLA out of memory, a bug) is raised, the step kept: a step
    # taken for damaged is deleted when the run saves that step again.
    except (OSError, ValueError) as e:
      # A checkpoint saved before its metadata recorded the empty containers: orbax's
      # refusal of the trees is the only sign of other containers.
      if saved_empty is None and _orbax_other_containers(e):
        raise ValueError(self._containers_line(step, _orbax_containers(e))) from None
      # TensorStore appends "See full TensorStore details: <its spec as a dict>": noise here
      said = str(e).split(" See full TensorStore details")[0]
      problem = f"its arrays cannot be read ({type(e).__name__}: {' '.join(said.split())[:300]})"
    except Exception as e:  # noqa: BLE001  (raised below, once every process knows)
      error = e
    verdict = _worst(2 if error is not None else 0 if problem is None else 1)
    if verdict == 2:
      kept = (f"Checkpoint {self.directory}/{step} is kept: restoring it failed with no sign "
              "of damage (a file that cannot be read or decoded, bytes unlike those saved)")
      if error is None:
        raise RuntimeError(f"{kept}, on another process; see its error.")
      error.add_note(f"{kept}.")
      raise error
    if verdict == 1:
      return problem or "another process could not read its arrays", None
    if cast and jax.process_index() == 0:  # as orbax and flax do, the saved values take the
      # restoring state's dtype; every process casts the same leaves: said once per job
      shown = ", ".join(f"{n} ({a} -> {b})" for n, a, b in cast[:3])
      warnings.warn(
        f"Checkpoint {self.directory}/{step}: {len(cast)} leaf(s) saved in another dtype "
        f"were cast to the trainer's: {shown}{' ...' if len(cast) > 3 else ''}; to keep "
        "the saved precision, init the trainer with parameters of the saved dtype.",
        stacklevel=3,
      )
    return None, (meta, restored, residual, why)

  def _containers_line(self, step: int, where: str) -> str:
    """The line for a checkpoint of the same leaves as the trainer's, in other containers."""
    return (
      f"Checkpoint {self.directory}/{step} does not match the trainer's model: the same "
      f"leaves, but the optimizer state's containers differ ({where}), e.g. adam saved and "
      "adamw restoring (its weight decay holds no state). Restore into a trainer built with "
      "the saved optimizer (then `trainer.import_state(saved_trainer.export_state(state))` "
      "goes on with this one), or use another `directory`. The checkpoint is left as it is.")

  def _step_dirs(self) -> list[tuple[int, bool]]:
    """``(step, committed)`` of every step directory, oldest first."""
    return step_dirs(self.directory)

  def _clear_damaged(self, step: int) -> None:
    """Removes ``DIR/<step>`` if it is uncommitted or :meth:`restore` skipped it.

    A run that fell back to an older step saves the newer steps again; their
    damaged directories would otherwise block the save. Every process must
    call it: process 0 decides from its view of the directory and shares the
    decision (processes that list the directory at different moments would
    otherwise disagree on whether to wait at the barrier), deletes, and
    every process waits for it and then reloads its view of the steps.
    """
    dirs = dict(self._step_dirs())
    remove = step in dirs and (not dirs[step] or step in self._damaged)
    # A user's directory made since this Checkpointer opened: refused, never deleted
    # (process 0's finding, shared, so every process raises together).
    foreign = (_foreign_entries(os.path.join(str(self.directory), str(step)), step)
               if remove else [])
    if jax.process_count() > 1:
      remove, refuse = (bool(v) for v in multihost_utils.broadcast_one_to_all(
        np.asarray([remove, bool(foreign)], np.int32)))
      foreign = foreign or (["files jaxcoll does not write"] if refuse else [])
    if foreign:
      raise ValueError(_foreign_message(self.directory, step, foreign))
    if not remove:
      return
    if jax.process_index() == 0:
      warnings.warn(
        f"Removing the damaged or uncommitted checkpoint {self.directory}/{step} "
        "before saving that step again.",
        CorruptCheckpointWarning,
        stacklevel=3,
      )
      with contextlib.suppress(OSError):
        _remove_step_dir(self.directory, step)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxcoll_checkpoint_clear_{step}")
    self._damaged.discard(step)
    self._manager.reload()


# -- helpers ---------------------------------------------------------------------


def _export(trainer, state) -> dict:
  """The canonical state to write: without a second copy of the state where the
  trainer can (``export_state(copy=False)``: zero-copy views on XLA:CPU), else a copy."""
  import inspect  # noqa: PLC0415

  try:
    views = "copy" in inspect.signature(trainer.export_state).parameters
  except (TypeError, ValueError):  # pragma: no cover - a builtin or a mock
    views = False
  return trainer.export_state(state, copy=False) if views else trainer.export_state(state)


def _orbax_other_containers(error: Exception) -> bool:
  """Whether orbax refused a restore because the target's tree has other containers than
  the saved one (``optax.adamw``'s extra ``EmptyState`` where ``adam``'s state was saved:
  the leaves and their paths are the same, so the metadata check passed). Such a step is
  not damaged: it was skipped as damaged, and a save of that step deleted it. Only for
  checkpoints whose metadata lacks ``empty_containers`` (saved before it was recorded);
  the others are compared before orbax is asked."""
  return isinstance(error, ValueError) and "tree structures do not match" in str(error)


def _orbax_containers(error: Exception) -> str:
  """Where orbax found the trees differ, from its message: ``opt_state: this trainer
  (<class 'list'>, 3) vs the checkpoint (<class 'list'>, 2)`` (orbax's "Source" is the
  restore target, its "Target" what is on disk)."""
  text = " ".join(str(error).split())
  text = text.split("do not match:")[-1].split(" If this mismatch")[0].strip()
  return text.replace("- Source:", "this trainer").replace("- Target:", "vs the checkpoint")[:200]


def _without_empty(tree):
  """``tree`` with its zero-size leaves (e.g. a ``(0, 4)`` parameter) as None: orbax
  refuses to save arrays with zero size. Their shape and dtype are in the
  metadata's leaf list; :func:`_with_empty` puts them back on restore."""
  return jax.tree.map(lambda x: None if 0 in tuple(x.shape) else x, tree)


def _with_empty(restored, like):
  """``restored`` (orbax's, None where ``like`` has a zero-size leaf) with each
  such leaf made again, empty, with ``like``'s shape, dtype and sharding."""
  def fill(want, got):
    if 0 not in tuple(want.shape):
      return got
    sharding = getattr(want, "sharding", None)
    if sharding is None:
      return np.zeros(want.shape, want.dtype)
    return jax.make_array_from_callback(
      want.shape, sharding, lambda index: np.zeros(want.shape, want.dtype)[index])
  return jax.tree.map(fill, like, restored)


def _residual_layout(trainer) -> dict | None:
  """The trainer's :meth:`~jaxcoll.Trainer.residual_layout` (None: no residuals)."""
  layout = getattr(trainer, "residual_layout", None)
  return layout() if callable(layout) else None


def _residual_item(residual) -> dict:
  """The state's residuals (a tuple of per-bucket dicts) as the checkpoint's
  ``residual`` item: ``{"bucket_0000": {...}, ...}`` (leaves as they are)."""
  return {f"bucket_{i:04d}": dict(r) for i, r in enumerate(residual)}


def _residual_state(item: dict, buckets: int) -> tuple:
  """The inverse of :func:`_residual_item`."""
  return tuple(item[f"bucket_{i:04d}"] for i in range(buckets))


def _residuals_misfit(saved: dict | None, layout: dict | None, res_like) -> str | None:
  """Why a checkpoint's residuals (``meta["residual"]``) do not continue a
  trainer of ``layout`` and residuals ``res_like``; None when they do, or the
  trainer has none."""
  if layout is None:
    return None
  if saved is None:
    return ("the checkpoint holds no error-feedback residuals (saved without error feedback, "
            "or by a jaxcoll that did not keep them)")
  theirs = saved["layout"]
  if theirs != layout:
    keys = [k for k in sorted(set(theirs) | set(layout)) if theirs.get(k) != layout.get(k)]
    shown = ", ".join(
      f"{k}={theirs.get(k)!r} there, {layout.get(k)!r} here" if k != "buckets"
      else f"buckets: {len(theirs.get(k) or [])} there, {len(layout.get(k) or [])} here"
      + ("" if len(theirs.get(k) or []) != len(layout.get(k) or []) else " (other leaves)")
      for k in keys)
    return (f"they were saved under another layout ({shown}; restore under the saving run's "
            "compression, data-parallel size and bucket_bytes to continue exactly)")
  problems = canonical_lib.spec_mismatches(canonical_lib.saved_specs(saved["leaves"]),
                                           canonical_lib.leaf_specs(res_like))
  if problems:
    return f"their shapes differ from this trainer's ({'; '.join(problems[:3])})"
  return None


def _pin(leaves) -> tuple:
  """Zero-copy host views of every addressable shard of ``leaves`` on XLA:CPU
  (nothing elsewhere: there a view would be a host copy, and the leaves are copies)."""
  pins = []
  for x in leaves:
    if not isinstance(x, jax.Array):
      continue
    for shard in x.addressable_shards:
      if shard.device.platform != "cpu":
        return ()
      pins.append(np.asarray(shard.data))
  return tuple(pins)


def _check_index(value, name: str) -> int:
  """A non-negative int from an int or an integer scalar array (``state.step``)."""
  if isinstance(value, (jax.Array, np.ndarray, np.integer)) and np.ndim(value) == 0:
    if np.issubdtype(value.dtype, np.integer):
      value = int(value)
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"`{name}` must be a non-negative int; got {value!r}.")
  return value


# The longest path jaxcoll writes below a workdir, with a margin: e.g.
# checkpoints/<step>.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_<p>/d/<32 hex>
# (~125 characters) or tensorboard/events.out.tfevents.<s>.<host>.<ns>.<pid>.
ROOM_UNDER_WORKDIR = 256


def check_writable(directory, what: str = "directory", *, room: int = 0) -> str | epath.Path:
  """Creates ``directory`` and proves it writable (local paths).

  Args:
    directory: the directory.
    what: how the error names it, e.g. ``"--workdir"``.
    room: characters the paths written below it add (a path longer than the
      file system's ``PATH_MAX`` fails only when that file is written).

  Raises:
    ValueError: naming ``what`` (e.g. ``"--workdir"``) and the directory:
      not creatable or writable, or too long for ``room`` more characters.
      Nothing is created.
    jaxcoll.disk.DiskFullError: no space left to write the probe; the
      directories this call created are removed again.
  """
  text = os.fspath(directory)
  if "://" in text:  # gs:// and friends: orbax reports its own errors
    return epath.Path(text)
  path = os.path.abspath(text)
  if room:
    _check_path_length(path, what, text, room)
  if os.path.lexists(path) and not os.path.isdir(path):
    raise ValueError(f"`{what}`={text!r} is not a directory (a file is in its place); move it "
                     "away or pass another directory.")
  probe = os.path.join(path, f".jaxcoll-write-test-{uuid.uuid4().hex}")
  created, parent = [], path
  while parent and not os.path.lexists(parent):
    created.append(parent)
    parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
  try:
    os.makedirs(path, exist_ok=True)
    with open(probe, "w") as f:
      f.write("ok")
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.remove(probe)
    for made in created:  # deepest first: leave nothing behind
      with contextlib.suppress(OSError):
        os.rmdir(made)
    if disk.is_full(e):
      raise disk.DiskFullError(
        f"disk full: no space left on the device of `{what}`={text!r} ({e.strerror or e}); "
        "free space or use another directory. Nothing was written."
      ) from None
    if not created and _holds_files(path):  # a run's state, say: the fix is not another dir
      raise ValueError(
        f"`{what}`={text!r} is not writable ({e.strerror or e}) and holds files "
        f"({', '.join(sorted(os.listdir(path))[:4])}): nothing in it was changed. Make it "
        "writable (e.g. remount it read-write) to go on from them, or copy it and pass the copy."
      ) from None
    raise ValueError(
      f"`{what}`={text!r} is not a writable directory ({e.strerror or e}); "
      "pass a directory this process can create and write."
    ) from None
  return path


def _holds_files(path: str) -> bool:
  try:
    return bool(os.listdir(path))
  except OSError:
    return False


def _check_path_length(path: str, what: str, text: str, room: int) -> None:
  """``path`` plus ``room`` characters fits the file system's ``PATH_MAX``,
  and each of its names ``NAME_MAX``."""
  existing = path
  while not os.path.exists(existing) and os.path.dirname(existing) != existing:
    existing = os.path.dirname(existing)
  try:
    path_max = os.pathconf(existing, "PC_PATH_MAX")
    name_max = os.pathconf(existing, "PC_NAME_MAX")
  except (OSError, ValueError):  # pragma: no cover - not POSIX
    path_max, name_max = 4096, 255
  long_name = max(path.split(os.sep), key=len)
  if len(long_name.encode()) > name_max:
    raise ValueError(
      f"`{what}` holds a name of {len(long_name.encode())} bytes ({long_name[:40]}...) and this "
      f"file system allows {name_max} (NAME_MAX); pass a shorter path."
    )
  if len(path.encode()) + room >= path_max:
    raise ValueError(
      f"`{what}` is {len(path.encode())} bytes long ({text[:40]}...) and the files written below "
      f"it add up to {room} more, but paths on this system are limited to {path_max} bytes "
      f"(PATH_MAX); pass a path of at most {path_max - room - 1} bytes."
    )


_DELETING = ".jaxcoll-deleting"  # a step being deleted (a digit-only name is a step)
# What orbax writes at the top of a step directory: jaxcoll's items and orbax's own files.
_STEP_ENTRIES = frozenset({_STATE, _META, _RESIDUAL, COMMIT_SUCCESS_FILE, "_CHECKPOINT_METADATA",
                           "descriptor"})


def _foreign_entries(path: str, step: int) -> list[str]:
  """Why jaxcoll did not write the step directory ``path`` as ``step``: the
  entries neither jaxcoll nor orbax writes, or (a copy made by hand) the step
  its metadata names; empty if it did (or it is damaged: then it is jaxcoll's)."""
  try:
    foreign = sorted(name for name in os.listdir(path) if name not in _STEP_ENTRIES)
  except OSError:
    return []
  if foreign:
    return foreign
  try:
    with open(os.path.join(path, _META, "metadata")) as f:
      saved = json.load(f).get("step")
  except (OSError, ValueError, AttributeError):
    return []
  if isinstance(saved, int) and saved != step:
    return [f"a copy of step {saved}"]
  return []


def _refuse_foreign_steps(directory) -> None:
  """A ValueError if a step directory (``DIR/12``) holds files jaxcoll did not write.

  A damaged or uncommitted step is removed when that step is saved again, and
  an old one when ``keep`` prunes it; a directory of the user's own files so
  named would be lost with it, so the run is refused before it starts (and,
  for one made during the run, before that save: :meth:`Checkpointer._clear_damaged`)."""
  if "://" in str(directory):
    return
  for step, _ in step_dirs(directory):
    foreign = _foreign_entries(os.path.join(str(directory), str(step)), step)
    if foreign:
      raise ValueError(_foreign_message(directory, step, foreign))
  # A file (not a directory) named as a step (`DIR/16`): orbax's save of that step
  # replaced it, silently.
  with contextlib.suppress(OSError):
    for name in sorted(os.listdir(str(directory))):
      path = os.path.join(str(directory), name)
      if disk.step_of(name) is not None and not os.path.isdir(path):
        raise ValueError(
          f"`directory` {directory} holds the file {path}, which jaxcoll did not write; a "
          f"save of step {name} would replace it. Move it out of {directory} (or rename it, "
          f"e.g. to {int(name):03d}-mine: only names like {name} are steps) and run again.")


def _foreign_message(directory, step: int, foreign: list[str]) -> str:
  path = os.path.join(str(directory), str(step))
  shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
  return (
    f"`directory` {directory} holds {path}, which jaxcoll did not write (it holds {shown}); "
    f"a save or prune of step {step} would remove it. Move it out of {directory} (or rename "
    f"it, e.g. to {step:03d}-mine: only names like {step} are steps) and run again."
  )


def _remove_step_dir(directory, step: int) -> None:
  """Deletes ``directory/<step>``: renamed first (atomic), so a listing sees
  the whole step or none of it, then removed. A leftover of a deletion
  interrupted by a kill is finished the next time."""
  path = os.path.join(str(directory), str(step))
  doomed = f"{path}{_DELETING}"
  if os.path.lexists(doomed):
    shutil.rmtree(doomed)
  os.rename(path, doomed)
  shutil.rmtree(doomed)


def _finish_deletions(directory) -> None:
  """Removes what a deletion interrupted by a kill left (``<step>.jaxcoll-deleting``)."""
  with contextlib.suppress(OSError):
    for name in os.listdir(str(directory)):
      if name.endswith(_DELETING):
        shutil.rmtree(os.path.join(str(directory), name), ignore_errors=True)


def _json_sha256(meta: dict) -> str:
  """sha256 of ``meta`` without its checksum field, as canonical JSON."""
  body = {k: v for k, v in meta.items() if k != _META_CHECKSUM}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class _OtherFormat(ValueError):
  """A checkpoint another version of jaxcoll wrote: not damage (a save of its step must
  never replace it, as one replaces a damaged step)."""


def _check_meta_checksum(meta: dict) -> None:
  if meta.get("format") != FORMAT_VERSION and isinstance(meta.get("format"), int):
    raise _OtherFormat(f"format {meta.get('format')!r}, this version reads {FORMAT_VERSION}")
  if meta.get("format") != FORMAT_VERSION:
    raise ValueError(f"format {meta.get('format')!r}, this version reads {FORMAT_VERSION}")
  if meta.get(_META_CHECKSUM) != _json_sha256(meta):
    raise ValueError("its sha256 does not match its contents (changed after the save)")


def _everyone(ok: bool) -> bool:
  """True when ``ok`` holds on every process (every process must call)."""
  return _worst(0 if ok else 1) == 0


def _worst(level: int) -> int:
  """The largest ``level`` of every process (every process must call)."""
  if jax.process_count() == 1:
    return level
  return int(np.max(multihost_utils.process_allgather(np.asarray([level], np.int32))))


class _LeafChecks:
  """Per leaf: the fingerprint of its bits and whether it is finite.

  Computed where the shards live, in one program per model: each device sums
  its own shards (:func:`jaxcoll.fingerprint.block_sum`) a chunk at a time,
  and the sums meet in one all-reduce, so the check of a sharded state never
  gathers a leaf nor holds a leaf-sized temporary (one program over whole
  leaves takes a temporary as large as the state on XLA:CPU). Leaves that
  are not on one mesh fall back to :func:`jaxcoll.fingerprint.fingerprint`.
  """

  def __init__(self):
    self._programs = {}

  def __call__(self, leaves) -> tuple[list[int], list[bool]]:
    """``(fingerprints, finite flags)`` of ``leaves`` as Python values."""
    leaves = list(leaves)
    if not leaves:
      return [], []
    shardings = [getattr(x, "sharding", None) for x in leaves]
    meshes = {s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)}
    if len(meshes) != 1 or not all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
      prints, finite = jax.jit(_whole_leaf_checks)(leaves)
      return np.asarray(prints).tolist(), np.asarray(finite).tolist()
    mesh = meshes.pop()
    specs = tuple(_full_spec(s.spec, x.ndim) for s, x in zip(shardings, leaves))
    key = (mesh, specs, tuple((x.shape, x.dtype) for x in leaves))
    if key not in self._programs:
      body = functools.partial(_sharded_checks, specs, [x.shape for x in leaves])
      in_specs = tuple(P(*s) for s in specs)
      self._programs[key] = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(P(), P()), check_vma=False))
    prints, finite = self._programs[key](*leaves)
    return np.asarray(prints).tolist(), np.asarray(finite).astype(bool).tolist()


def _full_spec(spec: P, ndim: int) -> tuple:
  """One entry per dimension: None or a tuple of mesh axis names."""
  entries = list(spec) + [None] * (ndim - len(spec))
  return tuple(None if e is None else (e if isinstance(e, tuple) else (e,)) for e in entries)


def _sharded_checks(specs, shapes, *blocks):
  """Inside shard_map: each leaf's fingerprint and finiteness from the local blocks."""
  prints, finite = [], []
  for spec, shape, block in zip(specs, shapes, blocks):
    start = [0 if names is None else jax.lax.axis_index(names) * block.shape[d]
             for d, names in enumerate(spec)]
    axes = tuple(name for names in spec if names for name in names)
    part, ok = fingerprint_lib.block_sum(block, start, shape), _all_finite(block)
    if axes:  # blocks are disjoint along the sharded axes, copies elsewhere
      part = jax.lax.psum(part, axes)
      ok = jax.lax.pmin(ok, axes)
    prints.append(part)
    finite.append(ok)
  return jnp.stack(prints), jnp.stack(finite)


_FINITE_CHUNK = 2**20  # elements read at a time (the reduction's input is materialized)


def _all_finite(block) -> jax.Array:
  """int32 1 unless ``block`` is floating point with a NaN or infinity (chunk by chunk)."""
  if not jnp.issubdtype(block.dtype, jnp.inexact):
    return jnp.int32(1)
  flat = block.reshape(-1)
  full = flat.shape[0] // _FINITE_CHUNK

  def chunk_ok(x):
    return jnp.all(jnp.isfinite(x)).astype(jnp.int32)

  ok = jnp.int32(1)
  if full:
    ok = jax.lax.fori_loop(0, full, lambda k, acc: acc & chunk_ok(
      jax.lax.dynamic_slice_in_dim(flat, k * _FINITE_CHUNK, _FINITE_CHUNK)), ok)
  if flat.shape[0] % _FINITE_CHUNK:
    ok = ok & chunk_ok(flat[full * _FINITE_CHUNK:])
  return ok


def _whole_leaf_checks(leaves):
  """Fingerprints and finite flags of whole leaves (leaves on no common mesh)."""
  flags = [
    jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    for x in leaves
  ]
  return fingerprint_lib.fingerprint(leaves), jnp.stack(flags)
