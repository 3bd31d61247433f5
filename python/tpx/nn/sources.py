"""The module a layer's ``from_*`` constructor converts, checked the same way for every layer
(1-D and multi-dimensional): its type, and the constructor arguments it supplies itself."""

from __future__ import annotations

from typing import Iterable, Optional

from torch import nn


def check_source(layer: type, method: str, source: nn.Module, expected: type,
                 kwargs: Optional[dict] = None, taken: Iterable[str] = ()) -> None:
    """Raises ``TypeError`` unless ``source`` is an ``expected`` (e.g. ``nn.Linear``), and
    ``ValueError`` if ``kwargs`` (the constructor's other arguments) names one of ``taken``,
    which come from ``source``."""
    if not isinstance(source, expected):
        raise TypeError(f"tpx.{layer.__name__}.{method} expects an nn.{expected.__name__}; got "
                        f"{type(source).__name__}")
    for key in taken:
        if kwargs and key in kwargs:
            raise ValueError(f"tpx.{layer.__name__}.{method}: `{key}` is taken from the "
                             f"nn.{expected.__name__}; do not pass it")
