"""Stand-ins for the checkpointer and the train input that a rollback calls
(:meth:`jaxcoll.run.incidents.Watch.respond`), for the incidents tests."""

from jaxcoll.run import data_skip


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
