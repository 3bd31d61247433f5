"""Random streams under tensor parallelism (dropout that is right under TP).

Two streams per device:

* the **replicated** stream is torch's default generator, seeded with the same seed on every
  rank of the TP group. Regions whose activations are replicated (the residual stream, the
  output of a row-parallel layer, embedding dropout) draw from it, so every rank draws the
  same mask and the replicated tensors stay identical across ranks.
* the **tensor-parallel** stream is seeded with ``seed + 2718 + rank``: regions whose
  activations are sharded (attention probabilities of this rank's heads, the output of a
  column-parallel layer) draw from it inside ``with tpx.random.fork():``, so different shards
  get independent masks.

Both are deterministic for a given seed and TP size. What is NOT reproduced bit for bit is
one device's run: a sharded region draws its masks per shard from a different stream than
one device would draw for the full tensor, so a TP run with dropout and a one-device run
with the same seed follow different (equally distributed) masks. With dropout off, or in a
replicated region, TP and one device agree.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from .comm.groups import GroupLike, resolve_group

__all__ = ["manual_seed", "fork", "is_seeded", "get_states", "set_states",
           "TENSOR_PARALLEL_SEED_OFFSET"]

TENSOR_PARALLEL_SEED_OFFSET = 2718

_seed: Optional[int] = None
_tp_seed: Optional[int] = None
# device string -> the saved state of the tensor-parallel stream on that device
_states: Dict[str, torch.Tensor] = {}


def manual_seed(seed: int, group: GroupLike = None) -> None:
    """Seeds both streams: torch's default generators with ``seed`` (the replicated stream;
    pass the same seed on every rank) and the tensor-parallel stream with ``seed +
    TENSOR_PARALLEL_SEED_OFFSET + rank`` (``rank`` in ``group``)."""
    global _seed, _tp_seed
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"tpx.random.manual_seed: `seed` must be an int; got {seed!r}")
    pg = resolve_group(group)
    torch.manual_seed(seed)
    _seed, _tp_seed = seed, seed + TENSOR_PARALLEL_SEED_OFFSET + dist.get_rank(pg)
    _states.clear()


def is_seeded() -> bool:
    """Whether :func:`manual_seed` has set up the tensor-parallel stream."""
    return _tp_seed is not None


def _get(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _initial_state(device: torch.device) -> torch.Tensor:
    saved = _get(device)
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(_tp_seed)
        else:
            torch.random.default_generator.manual_seed(_tp_seed)
        return _get(device)
    finally:
        _set(device, saved)


def _key(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Swap:
    """Swaps the device's default generator to the tensor-parallel stream and back."""

    def __init__(self, device) -> None:
        self.device = _key(torch.device(device))
        self.saved: Optional[torch.Tensor] = None

    def enter(self) -> None:
        if self.saved is not None:
            return
        name = str(self.device)
        if name not in _states:
            _states[name] = _initial_state(self.device)
        self.saved = _get(self.device)
        _set(self.device, _states[name])

    def exit(self) -> None:
        if self.saved is None:
            return
        _states[str(self.device)] = _get(self.device)
        _set(self.device, self.saved)
        self.saved = None


def _cuda_current() -> Optional[torch.device]:
    """The current CUDA device when CUDA is in use in this process, else None."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _default_devices() -> List[torch.device]:
    """What ``fork()`` swaps without a device: the CPU generator, and the current CUDA
    device's when CUDA is in use, so dropout inside draws per-rank masks wherever its tensor
    lives."""
    cuda = _cuda_current()
    return [torch.device("cpu")] + ([cuda] if cuda is not None else [])


@contextlib.contextmanager
def fork(device=None) -> Iterator[None]:
    """Runs the block on the tensor-parallel stream: random ops inside draw per-rank masks;
    the stream continues where the last ``fork`` left it, and the replicated stream is
    untouched. Requires :func:`manual_seed`.

    Args:
        device: whose generator to swap (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a
            ``torch.device``). ``None`` (the default) swaps the CPU generator and, when CUDA
            is in use, the current CUDA device's, so ``with tpx.random.fork():`` is right on
            either device.
    """
    if not is_seeded():
        raise RuntimeError("tpx.random.fork: call tpx.random.manual_seed(seed, group) on every "
                           "rank first")
    devices = _default_devices() if device is None else [device]
    swaps = [Swap(d) for d in devices]
    entered = []
    try:
        for swap in swaps:
            swap.enter()
            entered.append(swap)
        yield
    finally:
        for swap in reversed(entered):
            swap.exit()


def get_states() -> Dict[str, object]:
    """The seeds and the tensor-parallel streams' states (for a training checkpoint; the
    replicated stream is torch's own: save it with ``torch.get_rng_state``)."""
    return {"seed": _seed, "tp_seed": _tp_seed,
            "states": {k: v.clone() for k, v in _states.items()}}


def set_states(states: Dict[str, object]) -> None:
    """Restores what :func:`get_states` returned."""
    global _seed, _tp_seed
    _seed, _tp_seed = states["seed"], states["tp_seed"]
    _states.clear()
    _states.update({k: v.clone() for k, v in states["states"].items()})
