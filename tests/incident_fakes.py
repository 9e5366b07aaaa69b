"""Stand-ins for the checkpointer and the train input that a rollback calls
(:meth:`jaxcoll.run.incidents.Watch.respond`), for the incidents tests."""

from jaxcoll.run import data_skip
from jaxcoll.run import hooks as hooks_lib


class Killed(BaseException):
  """The stand-in for SIGKILL (a BaseException: nothing of the loop catches it)."""


class KillBefore(hooks_lib.Hook):
  """Raises :class:`Killed` before step ``step`` (the stand-in for a SIGKILL there)."""

  def __init__(self, step: int):
    self.step = step

  def before_step(self, step, batch, state):
    if step == self.step:
      raise Killed(f"killed before step {step}")
    return batch, state


class Checkpoints:
  """Intact checkpoints, each restoring with the extra it was saved with
  (``extras``: step -> extra; by default checkpoints 5 and 10 with none)."""

  directory = "/nonexistent"

  class _manager:  # noqa: N801
    @staticmethod
    def reload():
      pass

  def __init__(self, extras=None):
    self.extras = {5: {}, 10: {}} if extras is None else extras

  def wait(self):
    pass

  def all_steps(self):
    return sorted(self.extras)

  def metadata(self, step):
    return {"extra": self.extras[step]}

  def restore(self, trainer, step, **_):
    return f"state {step}", step, self.extras[step]


class Input:
  """The train input's batch numbering (:class:`jaxcoll.run.data_skip.BatchSchedule`)."""

  def __init__(self):
    self.schedule = data_skip.BatchSchedule()

  def batch_number(self, step):
    return self.schedule.batch_number(step)

  def restore(self, start, extra):
    pass

  def skip(self, first, last):
    self.schedule.add(first, last)
