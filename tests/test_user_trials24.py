"""Cases a user brought that no other test had tried (engineer trial24): planning a cluster
purchase with the scale planner through its public API, with flax models of their own (a
GRU classifier through nn.RNN, a model that does not trace). Each test of a fix fails
without it."""

import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxcoll.scale.step_model import WorkloadSpec

ROOT = str(pathlib.Path(__file__).resolve().parents[1])


class _GRUClassifier(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.RNN(nn.GRUCell(64))(x)  # the cell is built here, its scan runs inside nn.RNN
    return nn.Dense(10)(y[:, -1])


def test_from_flax_counts_the_parameters_of_a_cell_that_nn_rnn_scans():
  # flax's module table shows no variables for GRUCell_0: it had 650 of the 14,730 parameters
  # (the Dense head only), so every gradient bucket was 23x too small.
  batch = jax.ShapeDtypeStruct((4, 16, 8), jnp.float32)
  w = WorkloadSpec.from_flax(_GRUClassifier(), batch, achieved_flops=1e14)
  variables = _GRUClassifier().init(jax.random.key(0), jnp.zeros(batch.shape))
  assert w.num_params == sum(x.size for x in jax.tree.leaves(variables)) == 14730
  assert 14080 in w.layer_params and 650 in w.layer_params


class _ReshapesToSeven(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x.reshape(7, -1))


def test_from_flax_of_a_module_that_does_not_trace_is_one_value_error_line():
  # It was jax's TypeError from inside flax's module table, naming neither argument nor fix.
  batch = jax.ShapeDtypeStruct((4, 5), jnp.float32)
  with pytest.raises(ValueError, match=r"`module` _ReshapesToSeven does not trace on "
                     r"`example_args` of shapes \[\(4, 5\)\]: TypeError: cannot reshape") as e:
    WorkloadSpec.from_flax(_ReshapesToSeven(), batch, achieved_flops=1e14)
  assert "\n" not in str(e.value) and "pass the batch" in str(e.value)


def test_from_flax_of_an_empty_batch_is_one_value_error_line():
  # A batch of 0 examples divided the FLOPs by 0: ZeroDivisionError.
  with pytest.raises(ValueError, match=r"has 0 examples \(axis 0\); pass a batch of at least 1"):
    WorkloadSpec.from_flax(nn.Dense(8), jax.ShapeDtypeStruct((0, 5), jnp.float32),
                           achieved_flops=1e14)


def test_from_flax_of_an_nnx_module_that_does_not_trace_is_one_value_error_line():
  from flax import nnx  # noqa: PLC0415

  class ReshapesToSeven(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
      return self.dense(x.reshape(7, -1))

  with pytest.raises(ValueError, match=r"`module` ReshapesToSeven does not trace on "
                     r"`example_args` of shapes \[\(4, 5\)\]: TypeError: cannot reshape") as e:
    WorkloadSpec.from_flax(ReshapesToSeven(nnx.Rngs(0)), jax.ShapeDtypeStruct((4, 5), jnp.float32),
                           achieved_flops=1e14)
  assert "\n" not in str(e.value)


def test_knee_of_a_strategy_name_no_row_has_is_one_value_error_line():
  # knee(rows, "Zero-3", 0.9) returned None, which reads as "never below 90%", for a typo.
  from jaxcoll.comm_model.topology import Topology  # noqa: PLC0415
  from jaxcoll.scale.step_model import StepStrategy, knee, scaling  # noqa: PLC0415

  pcie = Topology.from_hardware(nodes=2, gpus_per_node=4, intra_links=1, intra_link_GBps=15.75,
                                inter_links=1, inter_link_Gbps=25)
  w = WorkloadSpec.from_numbers("x", num_params=1e8, flops_per_example=1e12,
                                achieved_flops=1e14, layers=7)
  rows = scaling(w, [StepStrategy(stage=3)], pcie, [1, 4, 8], per_device_batch=5)
  assert knee(rows, "ZeRO-3", 0.9) == 4  # 4 GPUs on one 15.75 GB/s PCIe link: 63%
  with pytest.raises(ValueError, match=r"`strategy` 'Zero-3' is not in `rows` \(their "
                     r"strategies: \['ZeRO-3'\]\)"):
    knee(rows, "Zero-3", 0.9)


def test_simulate_training_of_an_all_reduce_only_algorithm_with_zero_lines_is_one_line():
  # --algorithm=tree with the default --strategies printed the header, then failed on the
  # ZeRO-1 line: "Unknown all_gather `algorithm` 'tree'", an all_gather the user never named.
  ran = subprocess.run(
      [sys.executable, "-m", "experiments.simulate_training", "--workloads=resnet50",
       "--cluster=4,1,15.75,1,25", "--min_gpus=4", "--max_gpus=16", "--algorithm=tree"],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
      timeout=300, check=False)
  assert ran.returncode == 2 and ran.stdout == "", (ran.stdout, ran.stderr)
  assert ran.stderr.strip().splitlines() == [
      "simulate_training: error: `--algorithm`=tree is all-reduce only, and `--strategies` "
      "['zero1', 'zero2', 'zero3', 'hybrid'] run reduce-scatter and all-gather (the default "
      "--strategies has them); pass --strategies=dp, or an --algorithm of all three (valid "
      "choices: native, ring, hierarchical)."]
