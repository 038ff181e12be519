// Stands in for the CUDA header of the same name: cuda_emu.h, forced in front of every kernel file, has it all.
#pragma once
#include "../cuda_emu.h"
