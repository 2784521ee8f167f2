// kernels/cuda/rotary.cu for AMD GPUs: the CUDA source itself, compiled by hipcc through the
// CUDA dialect of include/hip_dialect.h. Its entry points are the CUDA source's
// `// kpt:launch` lines.
#include "include/hip_dialect.h"
#include "../cuda/rotary.cu"
