// kernels/cuda/quantize.cu for AMD GPUs: the CUDA source itself, compiled by hipcc through the
// CUDA dialect of include/hip_dialect.h (FP8 conversions: include/fp8_convert.h). Its
// entry points are the CUDA source's `// kpt:launch` lines.
#include "include/hip_dialect.h"
#include "../cuda/quantize.cu"
