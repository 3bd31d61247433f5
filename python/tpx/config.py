"""Every ``TPX_*`` environment variable tpx reads, parsed and validated in one place.

Each is read when it is used (a test or a script may change it between calls), and a value
tpx does not accept raises a ``ValueError`` that names the variable and what it takes.

========================  ===========  ==================================================
variable                  default      what it sets
========================  ===========  ==================================================
``TPX_DEBUG_CHECKS``      ``0``        ``1``: every collective op first checks that the
                                       ranks agree on its shapes and arguments
``TPX_RANK_CHECKS``       ``1``        ``0``: modules do not compare their configuration
                                       across ranks when they are built
``TPX_INPUT_CHECKS``      ``async``    value checks of inputs: ``async``, ``sync``, ``off``
``TPX_CHECK_REPLICAS``    ``0``        ``1``: replicas are compared after every backward
``TPX_INIT_CHUNK_BYTES``  64 MiB       bytes per step when initial weights are handed out
``TPX_FAULT_GRACE``       ``2``        seconds a failing rank waits for its peers
``TPX_ENTRY_GRACE``       ``30``       seconds a call that needs every rank (saving,
                                       loading, sharding) waits for them to enter it
``TPX_GLOO_ALLREDUCE``    ``gloo``     ``exchange``: two-rank all-reduce as one exchange
``TPX_GLOO_LOOP_POLICY``  ``batch``    ``keep``: leave gloo's event-loop threads as they are
========================  ===========  ==================================================

Read by the C++ extension itself: ``TPX_DEFAULT_CHUNKS`` (the pipeline depth when
``chunks=None``, read once per process), ``TPX_CPU_GEMM`` (``auto``, ``aten`` or ``onednn``,
read on every call). The test facilities are ``tpx._C.testing`` (``arm_fault``,
``wait_twice``), not environment variables.
"""

from __future__ import annotations

import os

__all__ = ["INPUT_CHECK_MODES", "GLOO_ALLREDUCE_CHOICES", "GLOO_LOOP_POLICIES", "check_replicas",
           "debug_checks", "entry_grace", "fault_grace", "gloo_allreduce", "gloo_loop_policy",
           "init_chunk_bytes", "input_checks", "rank_checks"]

INPUT_CHECK_MODES = ("async", "sync", "off")
GLOO_ALLREDUCE_CHOICES = ("gloo", "exchange")
GLOO_LOOP_POLICIES = ("batch", "keep")
_INIT_CHUNK_BYTES = 64 << 20


def debug_checks() -> bool:
    """``TPX_DEBUG_CHECKS=1``: every collective op first checks that the ranks agree."""
    return os.environ.get("TPX_DEBUG_CHECKS", "0") == "1"


def rank_checks() -> bool:
    """Whether modules compare their configuration across ranks when they are built
    (``TPX_RANK_CHECKS=0`` turns it off)."""
    return os.environ.get("TPX_RANK_CHECKS", "1") != "0"


def watch_replicas() -> bool:
    """``TPX_CHECK_REPLICAS=1``: ``parallelize_module`` makes the model compare its replicas
    after every backward."""
    return os.environ.get("TPX_CHECK_REPLICAS", "0") == "1"


def _choice(name: str, default: str, choices: tuple, meaning: str,
            fold_case: bool = False) -> str:
    """The value of ``name`` (``default`` when unset or empty; lower-cased with
    ``fold_case``), which must be one of ``choices``; ``meaning`` says what each does, for
    the error."""
    value = os.environ.get(name, "").strip()
    value = (value.lower() if fold_case else value) or default
    if value not in choices:
        raise ValueError(f"{name} must be {meaning}; got {value!r}")
    return value


def input_checks() -> str:
    """The mode of the value checks of inputs (``TPX_INPUT_CHECKS``: async, sync or off)."""
    return _choice("TPX_INPUT_CHECKS", "async", INPUT_CHECK_MODES,
                   f"one of {INPUT_CHECK_MODES}", fold_case=True)


def init_chunk_bytes() -> int:
    """Bytes the source rank sends per step when it hands out initial weights
    (``TPX_INIT_CHUNK_BYTES``, default 64 MiB)."""
    value = os.environ.get("TPX_INIT_CHUNK_BYTES")
    if value is None:
        return _INIT_CHUNK_BYTES
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"tpx: TPX_INIT_CHUNK_BYTES must be a positive integer; got {value!r}")
    return n


def fault_grace() -> float:
    """Seconds a rank whose tpx op failed waits for its peers to report (``TPX_FAULT_GRACE``,
    default 2)."""
    value = os.environ.get("TPX_FAULT_GRACE") or "2"
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"TPX_FAULT_GRACE must be a number of seconds >= 0; got '{value}'")
    return seconds


def entry_grace() -> float:
    """Seconds a call that needs every rank of its group (``save_pretrained``,
    ``tpx.checkpoint.save`` / ``load``, ``tpx.from_pretrained``, ``parallelize_module``, ...)
    waits on entry for the others before it raises naming the ranks that did not come
    (``TPX_ENTRY_GRACE``, default 30)."""
    value = os.environ.get("TPX_ENTRY_GRACE") or "30"
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"TPX_ENTRY_GRACE must be a number of seconds > 0; got '{value}'")
    return seconds


def gloo_allreduce() -> str:
    """How tpx's own two-rank gloo groups sum a buffer (``TPX_GLOO_ALLREDUCE``)."""
    return _choice("TPX_GLOO_ALLREDUCE", "gloo", GLOO_ALLREDUCE_CHOICES,
                   "'gloo' (the default: gloo's own all-reduce) or 'exchange' (a two-rank "
                   "all-reduce as one send/recv exchange and a local add)")


def gloo_loop_policy() -> str:
    """The scheduling policy of the event-loop threads of tpx's own gloo groups
    (``TPX_GLOO_LOOP_POLICY``)."""
    return _choice("TPX_GLOO_LOOP_POLICY", "batch", GLOO_LOOP_POLICIES,
                   "'batch' (the default: the event-loop thread of tpx's own gloo groups runs "
                   "as SCHED_BATCH) or 'keep' (leave it as gloo starts it)")
