"""Cases a user brought that no other test had tried (engineer trial26): their own data,
cluster and jobs; evaluation and the run report on run directories a user handled by hand.
Each test of a fix fails without it."""

import json
import warnings

import pytest

from jaxcoll.observe import metrics, run_report


def _eval_row(step, evaluated_at):
  return {"step": step, "eval_loss": 1.0 / step, "eval_examples": 10, "eval_data": "synthetic",
          "strategy": "DP(auto)", "num_devices": 8, "eval_time_s": 0.1,
          "evaluated_at": evaluated_at}


def test_an_eval_row_appended_after_a_torn_line_is_kept(tmp_path):
  """`experiments.eval` killed mid-write leaves a torn last line in evals.jsonl; the next
  `experiments.eval` said `recorded in .../evals.jsonl` but its row was glued to the torn
  line, and every reader (the report's `eval-only` line) dropped both: the newest evaluation
  lost without a word. Now the torn line is ended first: the row is read, the torn line is
  named and dropped."""
  (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 0.5, "step_time_s": 0.01}\n')
  metrics.append_eval_row(_eval_row(5, 1.0), str(tmp_path))
  with open(tmp_path / metrics.EVALS_NAME, "a") as f:
    f.write('{"step": 7, "eval_lo')  # killed mid-write
  metrics.append_eval_row(_eval_row(10, 3.0), str(tmp_path))
  with pytest.warns(metrics.TornLineWarning, match=r"line 2 \(not a JSON row\)"):
    rows = metrics.read_eval_rows(str(tmp_path))
  assert [r["step"] for r in rows] == [5, 10]
  with pytest.warns(metrics.TornLineWarning):
    run = run_report.load_run(str(tmp_path))
  assert "at checkpoint 10" in run_report.summarize(run)


@pytest.mark.parametrize("line", ["garbage{", "[1, 2]", '"text"', '{"eval_loss": 0.5}',
                                  '{"step": "3", "eval_loss": 0.5}'])
def test_a_line_of_evals_jsonl_that_is_not_a_row_is_a_warning_naming_it(line, tmp_path):
  """A line of evals.jsonl (or incidents.jsonl) that is not a JSON object with an integer
  step (a hand edit, a line of another tool) was skipped without a word, where the same
  line in metrics.jsonl is a TornLineWarning naming it. Now it is the same warning, with
  the file's own line number."""
  path = tmp_path / metrics.EVALS_NAME
  good = json.dumps(_eval_row(4, 1.0))
  path.write_text(f"{good}\n\n{line}\n{good}\n")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    rows = metrics.read_eval_rows(str(tmp_path))
  assert [r["step"] for r in rows] == [4, 4]
  (warning,) = caught
  assert warning.category is metrics.TornLineWarning
  assert f"line 3 (not a JSON row) of {path}" in str(warning.message), warning.message
  assert line[:8] in str(warning.message)

