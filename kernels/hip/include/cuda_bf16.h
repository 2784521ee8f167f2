// CUDA header name, HIP definitions: see hip_dialect.h.
#pragma once
#include "hip_dialect.h"
