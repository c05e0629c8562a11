/*
 * sdq-hooks.h: the one interface between the patched llama.cpp and sdq.
 *
 * The patches in patches/ call these hooks; the Rust library installs them at
 * run time with sdq_set_hooks(). With no table installed (the default), every
 * call site takes llama.cpp's own path, so the tools behave exactly as upstream.
 * Callbacks must not unwind or throw.
 */
#ifndef SDQ_HOOKS_H
#define SDQ_HOOKS_H

#include <stdbool.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SDQ_HOOKS_VERSION 1

/* The expert half of build_moe_ffn, after ggml's routing. */
struct sdq_moe_args {
    struct ggml_tensor * cur;              /* input activations [n_embd, n_tokens], F32 */
    struct ggml_tensor * selected_experts; /* [n_expert_used, n_tokens], I32 (a non-contiguous view) */
    struct ggml_tensor * weights;          /* [1, n_expert_used, n_tokens], F32, normalized/scaled as stock */
    struct ggml_tensor * gate_exps;        /* [n_embd, n_ff, n_expert], NULL when fused */
    struct ggml_tensor * up_exps;          /* [n_embd, n_ff, n_expert], NULL when fused */
    struct ggml_tensor * gate_up_exps;     /* [n_embd, 2*n_ff, n_expert], NULL when separate */
    struct ggml_tensor * down_exps;        /* [n_ff, n_embd, n_expert] */
    int64_t n_expert;
    int64_t n_expert_used;
    int32_t il;                            /* layer index */
    /* NULL when the layer is plain SwiGLU experts; otherwise what stock must do
     * that sdq does not (biases, scales, LoRA, clamps, other activations). */
    const char * unsupported;
};

struct sdq_hooks {
    uint32_t version;                      /* SDQ_HOOKS_VERSION */
    void * user_data;                      /* passed to every callback */

    /* Buffer type for weights that stay in the file; NULL pages nothing. The
     * loader neither prefetches nor reads tensors placed in it. */
    ggml_backend_buffer_type_t paged_buft;

    /* Loader: file idx of the model being loaded is `path` (split GGUFs give
     * one call per part). */
    void (*loader_file)(void * user_data, uint32_t idx, const char * path);

    /* Loader: should this weight be placed in paged_buft? */
    bool (*is_paged)(void * user_data, const struct ggml_tensor * meta);

    /* Loader: weight `t` (in paged_buft) has its bytes in file `idx` at `offs`. */
    void (*paged_weight)(void * user_data, const struct ggml_tensor * t, uint32_t idx, uint64_t offs);

    /* Graph: build the expert half of a MoE FFN, returning [n_embd, n_tokens]
     * F32, or NULL for llama.cpp's own graph. */
    struct ggml_tensor * (*build_moe)(void * user_data, struct ggml_context * ctx,
                                      struct ggml_cgraph * gf, const struct sdq_moe_args * args);
};

/* Install (or, with NULL, remove) the hook table. The table must outlive every
 * model loaded while it is installed. */
void sdq_set_hooks(const struct sdq_hooks * hooks);

/* The installed table, or NULL. */
const struct sdq_hooks * sdq_get_hooks(void);

/* True if `t` lives in the installed table's paged buffer type. */
bool sdq_is_paged_tensor(const struct ggml_tensor * t);

#ifdef __cplusplus
}
#endif

#endif /* SDQ_HOOKS_H */
