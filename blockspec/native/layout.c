/* The sizes and field offsets of the structs Python passes in (blockspec/native/structs.py mirrors them with ctypes
and checks every mirror against this table when the library loads). Why: a field added, moved or retyped on one side
only would shift every field after it and the kernels would read the wrong addresses; the check fails at load instead,
naming the struct and the field. */

#include <stddef.h>

#include "native.h"

#define SIZE(T) {#T, sizeof(T)}
#define FIELD(T, F) {#T "." #F, offsetof(T, F)}

static const struct {
    const char *name;
    size_t value;
} LAYOUT[] = {
    SIZE(qweight),
    FIELD(qweight, packed), FIELD(qweight, d), FIELD(qweight, m), FIELD(qweight, bias), FIELD(qweight, N),
    FIELD(qweight, K), FIELD(qweight, bits),
    SIZE(layer_weights),
    FIELD(layer_weights, input_norm), FIELD(layer_weights, post_norm), FIELD(layer_weights, q_norm),
    FIELD(layer_weights, k_norm), FIELD(layer_weights, qkv), FIELD(layer_weights, o), FIELD(layer_weights, gate_up),
    FIELD(layer_weights, down), FIELD(layer_weights, k_cache), FIELD(layer_weights, v_cache),
    SIZE(decoder_dims),
    FIELD(decoder_dims, hidden), FIELD(decoder_dims, heads), FIELD(decoder_dims, kv_heads),
    FIELD(decoder_dims, head_dim), FIELD(decoder_dims, intermediate), FIELD(decoder_dims, layers),
    FIELD(decoder_dims, eps), FIELD(decoder_dims, scale), FIELD(decoder_dims, threads), FIELD(decoder_dims, path),
    SIZE(decoder_batch),
    FIELD(decoder_batch, T), FIELD(decoder_batch, cos), FIELD(decoder_batch, sin), FIELD(decoder_batch, positions),
    FIELD(decoder_batch, slot_mapping), FIELD(decoder_batch, row_seq), FIELD(decoder_batch, kv_lens),
    FIELD(decoder_batch, block_tables), FIELD(decoder_batch, max_blocks), FIELD(decoder_batch, block_size),
    FIELD(decoder_batch, tap_layers), FIELD(decoder_batch, n_taps), FIELD(decoder_batch, query_start),
    FIELD(decoder_batch, last_rows), FIELD(decoder_batch, n_last),
    SIZE(context_batch),
    FIELD(context_batch, T), FIELD(context_batch, n_taps), FIELD(context_batch, cos), FIELD(context_batch, sin),
    FIELD(context_batch, slot_mapping),
};

/* "qweight": sizeof(qweight); "qweight.N": offsetof(qweight, N); -1: a name not in the table */
long long native_layout(const char *name) {
    for (size_t i = 0; i < sizeof LAYOUT / sizeof LAYOUT[0]; i++)
        if (strcmp(LAYOUT[i].name, name) == 0) return (long long)LAYOUT[i].value;
    return -1;
}
