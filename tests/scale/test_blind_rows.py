"""jaxcoll.scale.published.BLIND_ROWS: the inputs of a blind test, and its result.

The inputs' tests check keys, sources, configuration and the layer tables' parameter counts
against published counts. The rows were predicted once, after the model was frozen (README,
"Blind test"); test_blind_result_from_the_recorded_inputs keeps that result.
"""

import re

import pytest

from jaxcoll.scale import published

BLIND = published.BLIND_ROWS


def test_blind_rows_are_whole_tables_apart_from_the_validated_rows():
  keys = [r.key for r in BLIND]
  assert len(keys) == len(set(keys)) == 70
  assert not set(keys) & {r.key for r in published.ROWS}
  assert not set(keys) & set(published.FIT_KEYS)
  assert all(k.startswith("blind-") for k in keys)
  # the super-linear rule found nothing to leave out; every row is beyond its baseline
  assert published.BLIND_LEFT_OUT == {}
  assert len(published._BLIND_TABLES) == len(BLIND)


@pytest.mark.parametrize("r", BLIND, ids=lambda r: r.key)
def test_blind_row_inputs_are_well_formed(r):
  # the source names a repository at a 40-hex commit and a path
  assert re.search(r"@[0-9a-f]{40}:\S+README\.md", r.source), r.source
  assert r.model in published._LAYERS and r.cluster in published.CLUSTERS
  assert r.optimizer in published._OPTIMIZER and r.grad_bytes in (2, 4)
  assert r.precision in ("fp32", "tf32", "mixed")
  assert r.baseline_devices == 1 and r.num_devices in (4, 8, 16)
  assert r.accumulation == r.baseline_accumulation == 1
  assert r.gpu_rate == r.baseline_throughput > 0 and r.throughput > 0
  assert 0.5 < r.published_efficiency <= 1.0
  assert r.per_device_batch > 0
  assert r.input_workers in (None, 8, 16)
  # DataLoader workers only where a CPU decodes JPEGs (the PyTorch ConvNets rows)
  assert (r.input_workers is not None) == r.key.startswith(("blind-pt-rnxt", "blind-pt-sernxt"))
  # fp32 gradients on the wire unless the source sends fp16 (apex O2 / Horovod fp16)
  fp16_wire = r.precision == "mixed" and "squad" in r.key
  assert r.grad_bytes == (2 if fp16_wire else 4)


def _params(name):
  return int(sum(p for p, _ in published._LAYERS[name][1]()))


def test_layer_tables_match_the_published_parameter_counts():
  # osmr/imgclsmob@1b4ad655fa0e52e031dd9c10f690b51c828b4932:pytorch/pytorchcv/models/resnext.py
  # (_test: resnext101_32x4d weight_count == 44177704) and
  # osmr/imgclsmob@1d6feaf3fa4a18f83edca48848666c93955f2602:pytorch/pytorchcv/models/seresnext.py
  # (seresnext101_32x4d == 48955416, SE ratio 16): ~44.2M and ~49.0M.
  assert _params("resnext101_32x4d") == 44_177_704
  assert _params("se_resnext101_32x4d") == 48_955_416
  # DeepLearningExamples' PyTorch SE block squeezes to 16 channels, not C/16: its two
  # layers add 33 C + 16 per block over the 33 blocks' output widths.
  widths = [256] * 3 + [512] * 4 + [1024] * 23 + [2048] * 3
  assert _params("se_resnext101_32x4d_w16") == 44_177_704 + sum(33 * c + 16 for c in widths)
  # Transformer big, 33,712 shared words: ~210M.
  assert _params("transformer_big") == 210_882_560
  assert _params("transformer_big") == pytest.approx(210e6, rel=0.01)
  # BERT-large at 384 tokens: the same 336M parameters, more MACs per sequence.
  assert _params("bert_large_384") == _params("bert_large")
  macs = {n: sum(m for _, m in published._LAYERS[n][1]()) for n in ("bert_large",
                                                                    "bert_large_384")}
  # 3x the tokens, plus attention scores that grow with the square of the length
  assert 3.05 < macs["bert_large_384"] / macs["bert_large"] < 3.2


def test_blind_result_from_the_recorded_inputs():
  # Predicted once, after the model was frozen (README "Blind test"); from now on a check
  # that the recorded inputs and the model still give that result.
  import statistics  # noqa: PLC0415

  results = published.validate(rows=BLIND)
  errors = [r.error_pp for r in results]
  absolute = [abs(e) for e in errors]
  assert (len(absolute), sum(e <= 5 for e in absolute), sum(e <= 3 for e in absolute)) == (
      70, 33, 25)
  assert statistics.median(absolute) == pytest.approx(6.25, abs=0.05)
  assert statistics.mean(errors) == pytest.approx(5.79, abs=0.05)
  transformer = [r for r in results if r.row.model == "transformer_big"]
  assert len(transformer) == 14 and all(r.error_pp > 5 for r in transformer)
