"""Topology presets resized to other device counts."""

import pytest

from jaxcoll.comm_model import cost
from jaxcoll.comm_model.topology import Topology


def test_a_preset_node_of_fewer_devices_grows_by_whole_nodes_of_its_size():
  # Topology.preset("dgx-h100", local=4) is one node of 4 GPUs; resized to 16 it was 2 nodes
  # of 8 (NVLink across GPUs the user's nodes do not link), silently.
  four = Topology.preset("dgx-h100", local=4)
  assert four.resized(16).sizes == (4, 4) == Topology.preset("dgx-h100", nodes=4, local=4).sizes
  assert four.resized(16).levels == Topology.preset("dgx-h100", nodes=4, local=4).levels
  assert four.resized(8).sizes == (2, 4) and four.resized(2).sizes == (2,)
  # Part of a node (cluster's 4 of 8 GPUs) still grows to whole nodes of 8.
  part = Topology.cluster("dgx-h100", 4)
  assert part.resized(16).sizes == (2, 8) and part.resized(8).sizes == (8,)
  assert Topology.preset("dgx-h100").resized(64) == Topology.cluster("dgx-h100", 64)
  back = Topology.from_dict(four.to_dict())  # the node's links travel with it
  assert back.resized(16).levels == four.resized(16).levels


def test_a_preset_with_in_network_reduction_keeps_it_when_resized():
  # resized went through Topology.cluster(name, n), which dropped in_network_reduction=True:
  # a 1 GiB all-reduce on 16 H100s priced 5.8 ms instead of NVLS/SHARP's 2.7 ms.
  inr = Topology.preset("dgx-h100", in_network_reduction=True).resized(16)
  want = Topology.cluster("dgx-h100", 16, in_network_reduction=True)
  assert inr.levels == want.levels
  assert cost.estimate("all_reduce", 1 << 30, inr, "native") == pytest.approx(
      cost.estimate("all_reduce", 1 << 30, want, "native"))


def test_a_count_that_is_not_whole_nodes_is_named_as_the_caller_says():
  # step_model's baseline= / device_counts= gave the count: cluster and resized take `what`,
  # the name in their message (step_model rewrote their text by a regex on "`num_devices`=").
  for make in (lambda **kw: Topology.cluster("dgx-h100", 12, **kw),
               lambda **kw: Topology.preset("dgx-h100", nodes=2).resized(12, **kw),
               lambda **kw: Topology.preset("dgx-h100", local=4).resized(6, **kw)):
    with pytest.raises(ValueError, match=r"^`num_devices`=(12|6) is not a whole number of "):
      make()
    with pytest.raises(ValueError, match=r"^`baseline`=12 is not a whole number of (dgx-h100 )?"
                                         r"nodes of [48] devices; use a multiple of [48]"):
      make(what="`baseline`=12")
