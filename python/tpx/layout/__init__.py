"""How a tensor is laid out over the ranks, and how tpx's parameters say it.

* :mod:`~tpx.layout.dtensor_io`: ``DTensor`` in and out of tpx's layers (the placements are
  torch's own classes).
* :mod:`~tpx.layout.param_dtensors`: tpx's parameters as ``DTensor`` s, computing on their
  local tensors.
* :mod:`~tpx.layout.sharding`: what each parameter's shard is (group or mesh, dim, blocks),
  read by checkpoints and ``state_dict``.
* :mod:`~tpx.layout.initial`: initial weights, drawn or taken from a module on one rank and
  handed out in blocks.
"""
