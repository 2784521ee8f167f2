// Sizes of one attention call, passed by value to every attention kernel; the layout is
// kpt-nvidia's `AttentionDims` (#[repr(C)]), so a field added here is added there too.
#pragma once

namespace kpt {

struct AttentionDims {
    int batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal;
    float scale;
    int window;  // sliding window in keys, 0 = none
};

}  // namespace kpt
