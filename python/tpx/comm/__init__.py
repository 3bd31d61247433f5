"""Talking to other ranks: everything tpx's Python side communicates, and the groups it does it on.

* :mod:`~tpx.comm.groups`: resolving a group argument (``None``, a ``ProcessGroup``, a 1-D
  ``DeviceMesh``), the 1-D meshes over groups, and the split of a size over ranks
  (``shard_range``).
* :mod:`~tpx.comm.owned`: tpx's own copy of each gloo group it meets.
* :mod:`~tpx.comm.guard`: a failure on one rank is an error on every rank, promptly.
* :mod:`~tpx.comm.collectives`: every collective tpx issues from Python, through one path.
* :mod:`~tpx.comm.agree`: the ranks agreeing on arguments, checked once when a module is built.
* :mod:`~tpx.comm.entry`: calls every rank must make (saving, loading, sharding), entered by
  all of them or an error naming the ones that did not come.
* :mod:`~tpx.comm.checks`: value checks of inputs without a host synchronisation.
* :mod:`~tpx.comm.stats`: the collectives tpx issued, counted per group
  (``tpx.comm_stats``).
"""

from .stats import KINDS, CommStats, comm_stats, count_collective

__all__ = ["KINDS", "CommStats", "comm_stats", "count_collective"]
