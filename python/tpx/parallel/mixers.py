"""Which tpx style splits a sequence mixer: Mamba-2's and Mamba-1's
(:mod:`tpx.parallel.ssm`), Gated DeltaNet linear attention (:mod:`tpx.parallel.delta_net`),
LFM2's short convolution (:mod:`tpx.parallel.short_conv`).
Completed plans (:mod:`tpx.parallel.complete`) and derived plans (:mod:`tpx.parallel.derive`)
add the style :func:`mixer_style` names for each such module no entry covers."""

from __future__ import annotations

from typing import Optional

from torch import nn

from .base import ParallelStyle
from .delta_net import GatedDeltaNetParallel, is_gated_delta_net
from .short_conv import ShortConvParallel, is_short_conv
from .ssm import Mamba1Parallel, Mamba2Parallel, is_mamba1_mixer, is_mamba2_mixer, mamba2_rows

__all__ = ["mixer_style"]


def mixer_style(module: nn.Module) -> Optional[ParallelStyle]:
    """The style that splits ``module`` if it is a mixer tpx knows, else ``None``; it states
    the mixer's head counts where a TP size above them must keep it whole."""
    if is_mamba2_mixer(module):
        try:
            mamba2_rows(module, 1)  # sizes that fit its parts
        except ValueError:
            return None
        return Mamba2Parallel()
    if is_mamba1_mixer(module):
        return Mamba1Parallel()
    if is_gated_delta_net(module):
        return GatedDeltaNetParallel(int(module.num_k_heads), int(module.num_v_heads))
    if is_short_conv(module):
        return ShortConvParallel()
    return None
