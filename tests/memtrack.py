"""Peak bytes of CPU tensor storage allocated while a block runs (test helper).

Every tensor produced by an ATen op inside the block (factories, copies, collectives, views)
is seen through a ``TorchDispatchMode``; a storage it has not seen before counts from then
until the storage itself is freed (storages keep their Python object while alive, so a
``weakref.finalize`` on it fires when the memory is released, whichever tensors or
``Parameter`` wrappers held it). Storages that existed before the block (inputs) are not
counted: only what the block adds. Allocations a backend makes in its own threads are not seen.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _key(t: torch.Tensor):
    st = t.untyped_storage()
    return st, (st.data_ptr(), st.nbytes())


def _plain_cpu(t) -> bool:
    """A plain CPU tensor (a wrapper subclass such as ``DTensor`` has no storage of its own: the
    storage of its local tensor is seen where that tensor is made)."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and not t.is_meta)


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as m: ...`` then ``m.peak`` (bytes) and ``m.sizes`` (every new
    storage's size, in order of allocation)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.sizes: list = []
        self._ours: set = set()
        self._known: set = set()

    def _release(self, key) -> None:
        if key in self._ours:
            self._ours.discard(key)
            self.live -= key[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if _plain_cpu(t):
                st, key = _key(t)
                if key not in self._ours and key not in self._known:
                    self._known.add(key)
                    weakref.finalize(st, self._known.discard, key)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if _plain_cpu(t):
                st, key = _key(t)
                if key[1] == 0 or key in self._ours or key in self._known:
                    continue
                self._ours.add(key)
                self.live += key[1]
                self.peak = max(self.peak, self.live)
                self.sizes.append(key[1])
                weakref.finalize(st, self._release, key)
        return out
