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
#: The ``fail_at_step`` fault injection (process 0 exits abruptly, first attempt only).
EXIT_INJECTED_FAULT = 17
#: Disk full (ENOSPC): the checkpoints already written are intact.
EXIT_DISK_FULL = 74  # EX_IOERR
#: The peers of a multi-process job did not all connect within ``JAXCOLL_INIT_TIMEOUT_S``.
EXIT_INIT_TIMEOUT = 75  # EX_TEMPFAIL: retrying the whole job may help
#: No step (or checkpoint save) finished within the watchdog's limit.
EXIT_WATCHDOG = 86
#: The launcher's ``--timeout_s`` ran out (it stopped the job), as ``timeout(1)``.
EXIT_TIMEOUT = 124
#: Stopped by SIGTERM after the current step and a final checkpoint (:class:`StopRequested`).
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a process killed by SIGTERM

#: status -> what it means (README "Errors and exit statuses" lists the same).
EXIT_STATUSES: dict[int, str] = {
    EXIT_PARENT_GONE: "a launched worker whose launcher died before it started",
    EXIT_USAGE: "bad input (command line, configuration, environment, busy workdir): one "
                "line, nothing written, not restarted by `--max_restarts`",
    EXIT_NON_FINITE: "non-finite gradients (`nan_policy=\"raise\"`) or a non-finite state "
                     "refused by a save",
    EXIT_REPLICA_DESYNC: "replicas no longer identical (`check_every`, or at a save)",
    EXIT_INCIDENT_STOP: "an incident's response was `stop` (or `max_rollbacks` ran out), after a "
                        "final checkpoint marked as taken in an anomaly window",
    EXIT_INJECTED_FAULT: "the `fail_at_step` fault injection",
    EXIT_DISK_FULL: "disk full (ENOSPC); the checkpoints already written are intact",
    EXIT_INIT_TIMEOUT: "peers did not all connect within `JAXCOLL_INIT_TIMEOUT_S`",
    EXIT_WATCHDOG: "no step or checkpoint save finished within the watchdog's limit",
    EXIT_TIMEOUT: "the launcher's `--timeout_s` ran out",
    EXIT_TERMINATED: "stopped by SIGTERM after a final checkpoint",
}


# ------------------------------------------------------------------ exceptions


class ConfigError(ValueError):
  """Bad configuration (a config field, the workdir, a checkpoint that does
  not fit): the command line reports it in one line with exit status 2."""


class WorkdirBusyError(ValueError):
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


class StopRequested(Exception):
  """SIGTERM arrived; the loop stopped after ``step`` (checkpointed if ``saved``)."""

  def __init__(self, step: int, saved: bool):
    super().__init__(
        f"stopped by SIGTERM after step {step}"
        + ("; final checkpoint saved." if saved else "; no checkpoint saved (checkpointing off).")
    )
    self.step, self.saved = step, saved


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


# ------------------------------------------------------------------ warnings


class CorruptCheckpointWarning(UserWarning):
  """A checkpoint step was incomplete or damaged and has been skipped."""


class TornLineWarning(UserWarning):
  """The last line of metrics.jsonl was cut off (a kill or a full disk) and is dropped."""


#: class -> (where it comes from, exit status at the command line or None).
RAISED_BY: dict[type, tuple[str, int | None]] = {
    ConfigError: ("the training loop and its helpers (`jaxcoll.run`)", EXIT_USAGE),
    WorkdirBusyError: ("the workdir lock (`jaxcoll.run.lock`)", EXIT_USAGE),
    UsageError: ("the launcher's command line (`jaxcoll.runtime.launch`)", EXIT_USAGE),
    NonFiniteGradientsError: ("`Trainer.step` with `nan_policy=\"raise\"`", EXIT_NON_FINITE),
    NonFiniteStateError: ("`Checkpointer.save` (nothing written)", EXIT_NON_FINITE),
    ReplicaDesyncError: ("the runner's fingerprint check", EXIT_REPLICA_DESYNC),
    StopRequested: ("the runner after SIGTERM", EXIT_TERMINATED),
    IncidentStop: ("the runner, an incident's `stop` response", EXIT_INCIDENT_STOP),
    CorruptCheckpointWarning: ("`Checkpointer` (the step is skipped)", None),
    TornLineWarning: ("reading `metrics.jsonl` (the line is dropped)", None),
}
