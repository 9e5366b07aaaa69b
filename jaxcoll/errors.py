"""Every exception and warning class of jaxcoll, and every exit status.

One place to look up what went wrong: the classes below are raised (or
warned) by the library and the runner, and the ``EXIT_*`` statuses are what
``python -m experiments.train`` and ``python -m jaxcoll.launch`` end with.
The modules that raise them re-export them under their old names
(``jaxcoll.run.loop.ConfigError`` is :class:`ConfigError`). README
"Errors and exit statuses" is the same table (:data:`EXIT_STATUSES`, checked
by ``tests/test_errors.py``). A leaf module: it imports nothing of jaxcoll, so
every layer can raise from it.

Bad input to the library is a plain ``ValueError`` (or ``TypeError``) naming
the argument, the value and the fix; the classes here are the failures with
a meaning of their own.
"""

from __future__ import annotations

import errno
import signal

# ------------------------------------------------------------------ exit statuses

#: A launched worker whose launcher died before it started (it exits at once).
EXIT_PARENT_GONE = 1
#: Bad input: the command line, the configuration (:class:`ConfigError`), the
#: environment, a busy workdir; one line on stderr, nothing written, never restarted.
EXIT_USAGE = 2
#: Non-finite gradients with ``nan_policy="raise"`` (:class:`NonFiniteGradientsError`)
#: or a non-finite state refused by a save (:class:`NonFiniteStateError`).
EXIT_NON_FINITE = 3
#: Replicas that are no longer identical (:class:`ReplicaDesyncError`).
EXIT_REPLICA_DESYNC = 4
#: An incident's response was ``stop`` (:class:`IncidentStop`; README "Incidents and rollback").
EXIT_INCIDENT_STOP = 5
#: The ``fail_at_step`` fault injection (process ``fail_process`` exits abruptly, first attempt
#: only).
EXIT_INJECTED_FAULT = 17
#: Disk full (ENOSPC): the checkpoints already written are intact.
EXIT_DISK_FULL = 74  # EX_IOERR
#: The peers of a multi-process job did not all connect within ``JAXCOLL_INIT_TIMEOUT_S``.
EXIT_INIT_TIMEOUT = 75  # EX_TEMPFAIL: retrying the whole job may help
#: A process of the job died (killed by a signal, or its host lost): the others end at
#: once (:mod:`jaxcoll.runtime.liveness`) instead of waiting in a collective.
EXIT_PEER_GONE = 76  # EX_PROTOCOL
#: No step (or checkpoint save) finished within the watchdog's limit.
EXIT_WATCHDOG = 86
#: The launcher's ``--timeout_s`` ran out (it stopped the job), as ``timeout(1)``.
EXIT_TIMEOUT = 124
#: Stopped by SIGTERM after the current step and a final checkpoint (:class:`StopRequested`).
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a process killed by SIGTERM
#: Stopped by SIGINT (Ctrl-C) after the current step and a final checkpoint (or, before
#: the training loop, at once with nothing written).
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a process killed by Ctrl-C
#: Stopped by SIGHUP (a closed terminal) after the current step and a final checkpoint.
EXIT_HANGUP = 128 + signal.SIGHUP  # 129
#: Stopped by SIGUSR1 after the current step and a final checkpoint: the stop request that
#: reaches every rank under Open MPI (``kill -USR1`` of mpirun, which forwards it, where its
#: SIGTERM and Ctrl-C give the ranks 1 s before SIGKILL) and Slurm (``--signal=USR1@120``).
EXIT_STOP_REQUEST = 128 + signal.SIGUSR1  # 138

#: status -> what it means (README "Errors and exit statuses" lists the same).
EXIT_STATUSES: dict[int, str] = {
    EXIT_PARENT_GONE: "a launched worker whose launcher died before it started",
    EXIT_USAGE: "bad input (command line, configuration, environment, busy workdir): one "
                "line, nothing written, not restarted by `--max_restarts`",
    EXIT_NON_FINITE: "non-finite gradients (`nan_policy=\"raise\"`), a non-finite state "
                     "refused by a save, a non-finite final loss, or every step skipped",
    EXIT_REPLICA_DESYNC: "replicas no longer identical (`check_every`, or at a save)",
    EXIT_INCIDENT_STOP: "an incident's response was `stop` (or `max_rollbacks` ran out), after a "
                        "final checkpoint marked as taken in an anomaly window",
    EXIT_INJECTED_FAULT: "the `fail_at_step` fault injection (process `fail_process`)",
    EXIT_DISK_FULL: "disk full (ENOSPC); the checkpoints already written are intact",
    EXIT_INIT_TIMEOUT: "peers did not all connect within `JAXCOLL_INIT_TIMEOUT_S`",
    EXIT_PEER_GONE: "another process of the job died (killed, or its host lost): this one "
                    "ended at once instead of waiting in a collective",
    EXIT_WATCHDOG: "no step or checkpoint save finished within the watchdog's limit",
    EXIT_TIMEOUT: "the launcher's `--timeout_s` ran out",
    EXIT_TERMINATED: "stopped by SIGTERM after a final checkpoint",
    EXIT_INTERRUPTED: "stopped by SIGINT (Ctrl-C) after a final checkpoint; before the "
                      "training loop at once, nothing written",
    EXIT_HANGUP: "stopped by SIGHUP (a closed terminal) after a final checkpoint",
    EXIT_STOP_REQUEST: "stopped by SIGUSR1 (a stop request; under mpirun, which forwards it "
                       "to every rank) after a final checkpoint",
}


# ------------------------------------------------------------------ exceptions


class ConfigError(ValueError):
  """Bad configuration (a config field, the workdir, a checkpoint that does
  not fit): the command line reports it in one line with exit status 2."""


class DataError(ValueError):
  """A data file that cannot be read, or holds values the model cannot take.

  The message names the file (and its row group or record) and the fix. The
  runner reports it in one line with exit status 2 (bad input: the launcher
  does not restart it), whichever reader thread met it first.
  """


class WorkdirLockError(ValueError):
  """The workdir's lock cannot be taken (a directory in its place, a file this
  process may not open): bad input."""


class WorkdirBusyError(WorkdirLockError):
  """Another live job holds the workdir."""


class UsageError(Exception):
  """Bad command-line input: reported in one line, exit status 2."""


class NonFiniteGradientsError(FloatingPointError):
  """A step with ``nan_policy="raise"`` found non-finite gradients.

  The step was not applied. The state it returned (unchanged, as with
  ``nan_policy="skip"``) travels with the error, since the state passed to
  ``Trainer.step`` was donated and can no longer be used.

  Attributes:
    state: the unchanged ``TrainState`` (save it, or keep training from it).
    step: the number of the step that failed (``int(state.step) + 1``).
  """

  def __init__(self, message: str, *, state, step: int):
    super().__init__(message)
    self.state = state
    self.step = step


class NonFiniteStateError(FloatingPointError):
  """The state to save holds NaN or infinite values; nothing was written."""


class ReplicaDesyncError(RuntimeError):
  """The fingerprint check found replicas that are no longer identical."""


class DiskFullError(OSError):
  """No space (or quota) left where jaxcoll writes, wherever it surfaced (an
  orbax save included: :func:`jaxcoll.disk.is_full`); the message says where
  and what is kept. ``errno`` is ``ENOSPC``; ``str()`` is the message alone."""

  def __init__(self, message: str):
    super().__init__(errno.ENOSPC, message)

  def __str__(self) -> str:
    return str(self.strerror)


class CheckpointSaveError(RuntimeError):
  """A checkpoint save failed for another reason than a full disk (e.g. its
  directory removed under it); that step is not committed, older ones are kept."""


class EvalError(RuntimeError):
  """The evaluation after a step failed (the step's checkpoint, if it has
  one, is saved first); the original error is its ``__cause__``."""


class StopRequested(Exception):
  """SIGTERM, SIGINT, SIGHUP or SIGUSR1 arrived; the loop stopped after ``step``
  (checkpointed if ``saved``). ``status`` is the exit status it stands for
  (128 + the signal: :data:`EXIT_TERMINATED`, :data:`EXIT_INTERRUPTED`,
  :data:`EXIT_HANGUP`, :data:`EXIT_STOP_REQUEST`)."""

  def __init__(self, step: int, saved: bool, signum: int = signal.SIGTERM):
    super().__init__(
        f"stopped by {signal.Signals(signum).name} after step {step}"
        + ("; final checkpoint saved." if saved else "; no checkpoint saved (checkpointing off).")
    )
    self.step, self.saved, self.signum = step, saved, int(signum)
    self.status = 128 + int(signum)


class IncidentStop(StopRequested):
  """An incident's response was ``stop``: the run stopped after ``step``
  (:mod:`jaxcoll.run.incidents`)."""

  def __init__(self, step: int, saved: bool, signal: str, why: str = ""):  # noqa: ARG002
    Exception.__init__(
        self, f"stopped by incident {signal} at step {step}{why}"
        + ("; final checkpoint saved (marked as taken in an anomaly window: never a rollback "
           "target)." if saved else "; no final checkpoint saved.")
        + " See incidents.jsonl in the workdir.")
    self.step, self.saved, self.signal = step, saved, signal
    self.signum, self.status = 0, EXIT_INCIDENT_STOP


# ------------------------------------------------------------------ warnings


class CorruptCheckpointWarning(UserWarning):
  """A checkpoint step was incomplete or damaged and has been skipped."""


class NotElementwiseWarning(UserWarning):
  """Formerly: under ZeRO, an optimizer whose update reduces across parameter elements
  (``clip_by_global_norm`` in the chain, LAMB / LARS, adafactor) was computed by each device
  on its own rows. ZeRO now runs such an update on the full-shaped leaves (exact,
  :mod:`jaxcoll.train.mixing`), so nothing raises it; kept for code that filters it."""


class TornLineWarning(UserWarning):
  """A line of metrics.jsonl is not a JSON row (the last one cut off by a kill
  or a full disk; one in the middle damaged) and is dropped (a middle one kept
  aside in ``metrics.jsonl.unreadable-<time>``)."""


class UnreadFilesWarning(UserWarning):
  """A data directory given as ``data.train`` / ``data.eval`` holds files that are not read
  (no data extension, no Parquet magic without one), named once per process."""


#: class -> (where it comes from, exit status at the command line or None).
RAISED_BY: dict[type, tuple[str, int | None]] = {
    ConfigError: ("the training loop and its helpers (`jaxcoll.run`)", EXIT_USAGE),
    DataError: ("the file readers (`jaxcoll.data.sources`): a damaged, changed or unusable "
                "data file, named with its row group", EXIT_USAGE),
    WorkdirLockError: ("the workdir lock, a lock path it cannot use (`jaxcoll.run.lock`)",
                       EXIT_USAGE),
    WorkdirBusyError: ("the workdir lock (`jaxcoll.run.lock`)", EXIT_USAGE),
    UsageError: ("the launcher's command line (`jaxcoll.runtime.launch`)", EXIT_USAGE),
    NonFiniteGradientsError: ("`Trainer.step` with `nan_policy=\"raise\"`", EXIT_NON_FINITE),
    NonFiniteStateError: ("`Checkpointer.save` (nothing written)", EXIT_NON_FINITE),
    ReplicaDesyncError: ("the runner's fingerprint check", EXIT_REPLICA_DESYNC),
    DiskFullError: ("`Checkpointer`, `check_writable`, any write of the runner",
                    EXIT_DISK_FULL),
    CheckpointSaveError: ("`Checkpointer.save` / `wait` (one line, exit 1)", None),
    EvalError: ("the runner's evaluation (exit 1, with the cause's traceback)", None),
    StopRequested: ("the runner after SIGTERM (SIGINT: 130, SIGHUP: 129, SIGUSR1: 138)",
                    EXIT_TERMINATED),
    IncidentStop: ("the runner, an incident's `stop` response", EXIT_INCIDENT_STOP),
    CorruptCheckpointWarning: ("`Checkpointer` (the step is skipped)", None),
    NotElementwiseWarning: ("no longer raised: ZeRO runs an optimizer that reduces across "
                            "parameter elements exactly (kept so filters that name it still "
                            "import)", None),
    TornLineWarning: ("reading `metrics.jsonl` (the line is dropped)", None),
    UnreadFilesWarning: ("a data directory's files not read, named (`jaxcoll.data.sources`)",
                         None),
}
