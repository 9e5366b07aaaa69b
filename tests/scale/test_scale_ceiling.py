"""experiments.scale_ceiling: the synchronization forms and the in-sample ceiling (issue 21)."""

import dataclasses
import json
import sys

import pytest

from experiments import scale_ceiling as sc
from jaxcoll.scale import published
from jaxcoll.scale.step_model import DEFAULT_PARAMS
from tests import jobs


@pytest.fixture(scope="module")
def table():
  return sc.sides()


def test_the_decomposition_reproduces_the_shipped_model_on_every_row(table):
  # A row's step at zero synchronization plus the shipped form's term is published.predict.
  p = (DEFAULT_PARAMS.sync_s, DEFAULT_PARAMS.straggler_sigma, DEFAULT_PARAMS.loader_rate)
  assert len(table) == len(published.ROWS)
  for row, run, base in table:
    assert sc.efficiency("shipped", p, run, base) == pytest.approx(published.predict(row),
                                                                     rel=1e-12), row.key


def test_each_form_is_fitted_on_the_fitted_rows_and_its_ceiling_bounds_the_grid(table):
  lines, record = sc.run(3)
  assert set(record["forms"]) == set(sc.FORMS) and record["fitted_rows"] == 12
  shipped = record["forms"]["shipped"]
  # The shipped form fitted here is the repository's fit (published.fit -> DEFAULT_PARAMS).
  assert shipped["params"]["sigma"] == pytest.approx(DEFAULT_PARAMS.straggler_sigma, abs=2e-4)
  assert shipped["params"]["sync_s"] == pytest.approx(DEFAULT_PARAMS.sync_s, abs=1e-4)
  s = published.summary()
  assert shipped["held_out"]["within_5"] == s["held_out"].within_5
  for name, form in record["forms"].items():
    # No grid point of the form does better than its ceiling (checked at the grid's corners).
    (alo, ahi), (blo, bhi) = sc.FORMS[name][2]
    for a, b in ((alo, blo), (ahi, bhi), (alo, bhi)):
      hits = sum(abs(e) <= 5 for e in sc._errors_pp(name, (a, b, 130.0), table))
      assert hits <= form["ceiling_within_5"], name
    assert form["ceiling_within_5"] <= record["rows"]
  assert 0 < record["free_form_ceiling_within_5"] <= record["rows"]
  # The any-shape search reports what its own values score, and they are one per device count.
  at = record["any_shape_at"]
  g = {int(n): v for n, v in at["g"].items()}
  assert set(g) == {s.devices for _, r, b in table for s in (r, b) if s.devices > 1}
  assert sc._shape_hits(g, at["sync_s"], table) == record["any_shape_ceiling_within_5"]
  assert any(line.startswith("Any shape in N: ") for line in lines)
  assert any(line.startswith("| shipped |") for line in lines)
  assert set(record["refit_on_a_third"]) == set(sc.FORMS)
  refit = record["refit_on_a_third"]["shipped"]
  assert refit["fitted"]["rows"] + refit["held_out"]["rows"] == record["all_rows"]


def test_command_line_writes_the_table_and_json_and_bad_grid_is_one_line(tmp_path):
  out = jobs.forked([sys.executable, "-m", "experiments.scale_ceiling", "--grid=2",
                     f"--out={tmp_path}"])
  assert out.returncode == 0, out.stderr
  record = json.loads((tmp_path / "scale_ceiling.json").read_text())
  assert record["grid"] == 2 and "| two_level |" in (tmp_path / "table.txt").read_text()
  bad = jobs.forked([sys.executable, "-m", "experiments.scale_ceiling", "--grid=1"])
  assert jobs.one_line(bad) == (
      "scale_ceiling: error: --grid must be >= 2 (points per parameter); got 1. Pass e.g. "
      "--grid=21.")
  bad = jobs.forked([sys.executable, "-m", "experiments.scale_ceiling", "--restarts=-1"])
  assert jobs.one_line(bad) == (
      "scale_ceiling: error: --restarts must be >= 0 (random restarts of the any-shape search); "
      "got -1. Pass e.g. --restarts=100.")


def test_the_refit_on_a_third_of_every_row_holds_out_two_thirds_of_them():
  table = sc.sides(tuple(published.ROWS) + tuple(published.BLIND_ROWS))
  fitted, held = sc.thirds(table)
  keys = [t[0].key for t in fitted + held]
  assert sorted(keys) == sorted(t[0].key for t in table) and len(set(keys)) == len(keys)
  assert len(fitted) == -(-len(table) // 3)  # at most a third (rounded up), by the rule
  # The blind rows are in both parts: the rule does not keep them out of the fit.
  blind = {r.key for r in published.BLIND_ROWS}
  assert any(t[0].key in blind for t in fitted) and any(t[0].key in blind for t in held)


def test_the_any_shape_search_scores_rows_as_the_forms_do_and_finds_a_planted_shape(table):
  start = {s.devices: 0.0286 * sc._emax(s.devices) for _, r, b in table for s in (r, b)
           if s.devices > 1}
  # The search's score of the shipped form's shape is the shipped form's own (efficiency()).
  for sigma, sync_s in ((0.0286, 0.0014), (0.045, 0.0), (0.0, 0.003)):
    shape = {n: sigma * sc._emax(n) for n in start}
    assert sc._shape_hits(shape, sync_s, table) == sum(
        abs(e) <= 5 for e in sc._errors_pp("shipped", (sync_s, sigma, sc._SHAPE_LOADER), table))
  hits, at = sc.any_shape_ceiling(table, passes=1, starts=((0.0286, 0.0014),), restarts=1)
  assert hits >= sc._shape_hits(start, 0.0014, table)
  assert sc._shape_hits({int(n): v for n, v in at["g"].items()}, at["sync_s"], table) == hits
  # Rows whose published figures are what a known shape predicts: the search, started from
  # another shape, reaches every one of them.
  planted = {n: 0.02 * (1 + k) for k, n in enumerate(sorted(start))}
  fake = []
  for row, run, base in table:
    e = sc.shape_efficiency(planted, 0.0, run, base)
    fake.append((dataclasses.replace(row, efficiency=e), run, base))
  assert sc._shape_hits(start, 0.0, fake) < len(fake)
  hits, at = sc.any_shape_ceiling(fake, passes=2, starts=((0.0286, 0.0),))
  assert hits == len(fake), at
