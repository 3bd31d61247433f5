// Stands in for the CUDA header of this name in the emulated (CPU) build of the kernels.
#pragma once
#include "cuda_emu.h"
