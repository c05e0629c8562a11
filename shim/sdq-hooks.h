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
#include <stddef.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SDQ_HOOKS_VERSION 19

struct llama_model;

/* Where a weight goes (the is_paged hook). */
enum sdq_place {
    SDQ_STOCK = 0,         /* where llama.cpp put it, loaded as stock loads it */
    SDQ_PAGED = 1,         /* paged_buft: read from the file by this process's pager */
    SDQ_PAGED_ON_NODE = 2, /* its RPC buffer type, 4 KiB: paged by the node's
                            * pager from the node's copy of the model; never
                            * read or sent by this process */
};

#define SDQ_RPC_MAGIC 0x31716473u /* "sdq1" */

/* A host's claim on one routed-expert weight, carried to the node in the
 * op_params of the weight's rpc_tensor (GET_ALLOC_SIZE). */
struct sdq_rpc_claim {
    uint32_t magic;       /* SDQ_RPC_MAGIC */
    uint32_t file;        /* the model's split file index */
    uint64_t file_size;   /* that file's size in bytes */
    uint64_t offset;      /* the weight's bytes in that file */
    uint64_t header_hash; /* FNV-1a of the file's GGUF header (metadata and tensor table) */
    uint64_t sample_hash; /* FNV-1a of the weight's first and last 4 KiB */
};

/* sdq's op as it crosses to an RPC node, in the rpc_tensor's op_params
 * (instead of ggml_custom_op_params' function and userdata pointers). */
struct sdq_rpc_op {
    uint32_t magic;   /* SDQ_RPC_MAGIC */
    uint32_t kind;    /* enum sdq_rpc_op_kind */
    int32_t n_tasks;  /* ggml_custom_op_params.n_tasks */
    int32_t layer;    /* the op's layer (the predictor's own layer) */
    int32_t next;     /* the predictor's next paged layer */
    int32_t top_k;    /* the predictor's experts per token */
};

enum sdq_rpc_op_kind {
    SDQ_RPC_OP_EXPERTS = 1,    /* moe_experts */
    SDQ_RPC_OP_MUL_MAT_ID = 2, /* mul_mat_id */
    SDQ_RPC_OP_PREDICT = 3,    /* the next layer's prediction */
};

struct sdq_hooks {
    uint32_t version;                      /* SDQ_HOOKS_VERSION */
    void * user_data;                      /* passed to every callback */

    /* Buffer type for weights that stay in the file; NULL pages nothing. The
     * loader neither prefetches nor reads tensors placed in it. While it is
     * set, the AUTO load mode reads all other weights into memory (an explicit
     * mmap mode still maps them, and mapped_weight reports them). */
    ggml_backend_buffer_type_t paged_buft;

    /* Loader: file idx of the model being loaded is `path` (split GGUFs give
     * one call per part). */
    void (*loader_file)(void * user_data, uint32_t idx, const char * path);

    /* Loader: where this weight goes (enum sdq_place). `stock_buft` is the
     * buffer type llama.cpp chose for it (flags, overrides and CPU features
     * applied): its layout is the one sdq's kernels reproduce. */
    int (*is_paged)(void * user_data, const struct ggml_tensor * meta, ggml_backend_buffer_type_t stock_buft);

    /* Loader: weight `t` (in paged_buft, or paged on its RPC node) has its
     * bytes in file `idx` at `offs`. */
    void (*paged_weight)(void * user_data, const struct ggml_tensor * t, uint32_t idx, uint64_t offs);

    /* Loader: weight `t` is not paged (it is created, its data is not loaded
     * yet); it lives as long as the model. */
    void (*resident_weight)(void * user_data, const struct ggml_tensor * t);

    /* Loader: weight `t` (not paged) stays in the file mapping: its bytes are
     * file-backed page cache rather than anonymous memory. */
    void (*mapped_weight)(void * user_data, const struct ggml_tensor * t);

    /* Loader: the error a loader hook left (a file or weight sdq cannot
     * page, inside a host program), copied into buf (NUL-terminated, cut at
     * len) and forgotten; false if there is none. The loader throws it. */
    bool (*take_load_error)(void * user_data, char * buf, size_t len);

    /* Loader: the model whose files were reported last, `model`, has its
     * weights in memory (a dry run, such as common's parameter fitting,
     * never says so). */
    void (*model_loaded)(void * user_data, const struct llama_model * model);

    /* llama_model_free: `model` is gone (any model; sdq knows those it was
     * told were loaded). Called after it is freed: only its address. */
    void (*model_freed)(void * user_data, const struct llama_model * model);

    /* Graph: the expert matmul ggml_mul_mat_id(as, b, ids) for a weight `as`
     * placed in paged_buft. Returns a tensor of ggml_mul_mat_id's shape and
     * type ([as->ne[1], ids->ne[0], b->ne[2]], F32) computed from the paged
     * experts; everything around it (activation, biases, scales, LoRA, the
     * router-weighted sum) stays llama.cpp's own graph. */
    struct ggml_tensor * (*mul_mat_id)(void * user_data, struct ggml_context * ctx,
                                       struct ggml_tensor * as, struct ggml_tensor * b, struct ggml_tensor * ids);

    /* Graph: the routing of MoE layer `il`, whose experts are paged: `ids`
     * (I32 [n_expert_used, n_tokens], the selected experts) and `weights`
     * (F32 [1, n_expert_used, n_tokens], their final router weights). Returns
     * the ids the layer's expert ops use instead (same shape and values), or
     * NULL to keep `ids`. */
    struct ggml_tensor * (*moe_routing)(void * user_data, struct ggml_context * ctx, int il,
                                        struct ggml_tensor * ids, struct ggml_tensor * weights);

    /* Graph: the routed experts of one MoE layer with SwiGLU and no biases,
     * scales or LoRA, all paged: down(silu(gate(b)) * up(b)) for each
     * selected expert, [down->ne[1], ids->ne[0], b->ne[2]] F32, before the
     * router weights (which stay llama.cpp's ops). b is [n_embd, 1, n_tokens].
     * NULL leaves the layer to three mul_mat_id calls. */
    struct ggml_tensor * (*moe_experts)(void * user_data, struct ggml_context * ctx,
                                        struct ggml_tensor * gate, struct ggml_tensor * up, struct ggml_tensor * down,
                                        struct ggml_tensor * b, struct ggml_tensor * ids);

    /* Compute: should ggml stop the graph now? True once after an expert
     * read failed in a program that abandons the batch (llama-server, or a
     * program that loaded sdq's libllama); every context asks it after each
     * node, before the program's own abort callback. Any other tool ends on
     * such a failure. */
    bool (*abort_requested)(void * user_data);

    /* Compute: the error that abandoned the last batch, copied into buf
     * (NUL-terminated, cut at len) and forgotten; false if there is none. */
    bool (*take_batch_error)(void * user_data, char * buf, size_t len);

    /* Context: context `ctx` reserved `bytes` of compute buffers in host
     * memory (allocated, not yet touched; called again if it reserves anew).
     * A full ubatch asking one output per sequence, as a generating tool's
     * does, places its tensors within `one_output` bytes of them (more only
     * for a batch asking more outputs). */
    void (*compute_buffers)(void * user_data, const void * ctx, size_t bytes, size_t one_output);

    /* Context: a decode's next ubatch, of `n_tokens` tokens, starts at
     * position `pos0` of its (first) sequence; a prompt computed from its
     * start begins at 0. Called before the ubatch's graph is computed. */
    void (*ubatch_begins)(void * user_data, int32_t pos0, uint32_t n_tokens);

    /* Context: a decode of `n_ubatches` ubatches of `n_ubatch` tokens (the
     * last one may be shorter), one sequence's, asking at most one output:
     * how many of them to compute together, layer by layer across them
     * (sdq-pieces.h); 0 or 1 computes them one at a time, as stock. */
    uint32_t (*group_size)(void * user_data, uint32_t n_ubatches, uint32_t n_ubatch);
    /* Context: the next `n_ubatches` ubatches (`n_tokens` tokens) are
     * computed together, as one step, their staging holding `bytes` and
     * their expert ops' largest output `op_out` (as group_room says);
     * group_ends follows when they are computed or failed (it may also
     * follow a group that never began). */
    void (*group_begins)(void * user_data, uint32_t n_ubatches, uint32_t n_tokens, size_t bytes, size_t op_out);
    /* Context: `n_staged` ubatches of a group are staged, holding `bytes`
     * (their graphs and what they keep aside): true if another may be
     * staged, false to compute these now. With `n_staged` 0, `bytes` are
     * what a group's first ubatch would hold: true to stage it, false to
     * compute it and the batch's next ubatches one at a time, as stock.
     * `op_out`: the largest output of a staged ubatch's expert op, which
     * sdq keeps for each later ubatch where the first's op computes the
     * group's experts (group_layer). */
    bool (*group_room)(void * user_data, uint32_t n_staged, size_t bytes, size_t op_out);
    void (*group_ends)(void * user_data);
    /* Graph: the paged layer whose experts graph node `node` computes (one
     * of sdq's expert ops), or -1. A group's graphs are cut before each
     * layer's first such node. */
    int (*expert_layer)(void * user_data, const struct ggml_tensor * node);
    /* Compute: the routing of expert op `node` (expert_layer >= 0) is
     * computed, and the op runs once the group's other ubatches have had
     * their turn: its experts can be read now. */
    void (*experts_ahead)(void * user_data, const struct ggml_tensor * node);
    /* Compute: the group's `n` ubatches reach a paged layer, each at its
     * expert op `nodes[i]` (the first ubatch's runs first); kept[i *
     * GGML_MAX_SRC + j] is where source j of nodes[i] is kept aside (NULL
     * where it is not in the compute buffer), valid until ubatch i has
     * computed the op. sdq may compute every ubatch's experts in the
     * first's op, and the others' ops copy what it computed for them. */
    void (*group_layer)(void * user_data, uint32_t n, struct ggml_tensor * const * nodes, const void * const * kept);
    /* Server: the pager's figures in format `kind` (SDQ_REPORT_*), written
     * into buf (NUL-terminated, cut at len; buf may be NULL when len is 0).
     * Returns the text's whole length, as snprintf does. */
    size_t (*report)(void * user_data, int kind, char * buf, size_t len);
    /* Server: the tokens a batch holding several slots' tokens may hold
     * (stock's -b), where sdq raised the context's batch so that a prompt
     * alone in a batch goes whole (patch 0016); 0 where it did not. */
    int32_t (*shared_batch)(void * user_data);

    /* RPC, on the host (ggml's RPC backend, patch 0015). */
    /* Is `t` a weight paged on its RPC node (SDQ_PAGED_ON_NODE)? */
    bool (*remote_paged)(void * user_data, const struct ggml_tensor * t);
    /* Weight `t`, placed on RPC node `endpoint`: if it is paged there, fills
     * `claim` (what the node checks against its own copy of the model) and
     * returns true. */
    bool (*rpc_claim)(void * user_data, const struct ggml_tensor * t, const char * endpoint, struct sdq_rpc_claim * claim);
    /* The node answered the claim on `t` with `alloc_size`: returns the
     * size to allocate, sdq's 4 KiB either way; an answer other than that
     * (a stock rpc-server, one without -m, another model) leaves a load
     * error, which the loader throws before reading any weight. */
    size_t (*rpc_claimed)(void * user_data, const struct ggml_tensor * t, const char * endpoint, uint64_t alloc_size);
    /* Graph node `node` (a GGML_OP_CUSTOM) about to cross to an RPC node:
     * if it is one of sdq's ops, writes its name for the node into
     * `op_params` (struct sdq_rpc_op) and returns true. */
    bool (*rpc_encode_op)(void * user_data, const struct ggml_tensor * node, int32_t * op_params);
    /* Does RPC node `endpoint` page experts (so it is asked after each graph
     * whether the graph failed)? */
    bool (*rpc_node_pages)(void * user_data, const char * endpoint);
    /* The last graph on RPC node `endpoint` failed with `message` (the
     * node's own, e.g. a failed read): the batch is abandoned, as for a
     * local failed read. */
    void (*rpc_node_failed)(void * user_data, const char * endpoint, const char * message);
    /* The connection to RPC node `endpoint` broke during `what` (or a batch
     * placed on a node already lost needs it): reports it. A tool ends (does
     * not return); where the process can go on (`can_go_on`, and
     * llama-server or a host program) the batch fails, and true is
     * returned: nothing more is sent to the node. */
    bool (*rpc_node_lost)(void * user_data, const char * endpoint, const char * what, bool can_go_on);
    /* RPC nodes lost so far; -1 when no RPC node holds a layer. */
    int64_t (*rpc_losses)(void * user_data);

    /* RPC, on a node (rpc-server -m FILE with a budget). */
    /* The host claims weight `t` (name, type and shape from the wire) as
     * paged here: sdq's 4 KiB if this node's model has it where the claim
     * says, else 0 (logged here, and the host is told). */
    uint64_t (*node_claim)(void * user_data, const struct ggml_tensor * t, const struct sdq_rpc_claim * claim);
    /* The bytes a weight of this node takes in its RPC buffer: 4 KiB for a
     * claimed one, 0 for any other tensor (ggml_nbytes applies). */
    size_t (*node_weight_bytes)(void * user_data, const struct ggml_tensor * t);
    /* Graph node `node` arrived with sdq's name for an op (its sources are
     * linked): sets its function and userdata to this node's own. False if
     * this node cannot compute it. */
    bool (*node_bind_op)(void * user_data, struct ggml_tensor * node);
    /* The RPC buffers the host allocated here now hold `bytes` in all. */
    void (*node_buffers)(void * user_data, uint64_t bytes);
};

/* The endpoint ("host:port") of an RPC buffer type, or NULL for any other
 * (defined in ggml-rpc, patch 0015). */
const char * sdq_rpc_buft_endpoint(ggml_backend_buffer_type_t buft);

/* The hooks above through the installed table, each a no-op (false, 0)
 * without it; for ggml-rpc, which does not see the table's layout change. */
bool sdq_rpc_claim_weight(const struct ggml_tensor * t, const char * endpoint, struct sdq_rpc_claim * claim);
size_t sdq_rpc_claimed(const struct ggml_tensor * t, const char * endpoint, uint64_t alloc_size);
bool sdq_rpc_encode_op(const struct ggml_tensor * node, int32_t * op_params);
bool sdq_rpc_node_pages(const char * endpoint);
void sdq_rpc_node_failed(const char * endpoint, const char * message);
bool sdq_rpc_node_lost(const char * endpoint, const char * what, bool can_go_on);
int64_t sdq_rpc_losses(void);
uint64_t sdq_node_claim(const struct ggml_tensor * t, const struct sdq_rpc_claim * claim);
size_t sdq_node_weight_bytes(const struct ggml_tensor * t);
bool sdq_node_bind_op(struct ggml_tensor * node);
void sdq_node_buffers(uint64_t bytes);

enum sdq_report_kind {
    SDQ_REPORT_PROMETHEUS = 0, /* counters and gauges, Prometheus text format */
    SDQ_REPORT_PROPS = 1,      /* a JSON object: the budget and the arena */
    SDQ_REPORT_PROMPT = 2,     /* a JSON object: the prompt being computed, its
                                * tokens, bytes read and touched experts' bytes */
    SDQ_REPORT_PROMPT_NONE = 3, /* the same object for a prompt not begun: zeros */
};

/* The report hook, or 0 (nothing written) with no table installed. */
size_t sdq_report(int kind, char * buf, size_t len);

/* The shared_batch hook, or 0 with no table installed. */
int32_t sdq_shared_batch(void);

/* ggml abort callback (llama_set_abort_callback): the abort_requested hook,
 * or false with no table installed. */
bool sdq_abort_requested(void * data);

/* Throws (as std::runtime_error) the error the last loader hook left, if
 * any (take_load_error); the model loader calls it after each hook. */
void sdq_check_load(void);

/* The take_batch_error hook, or false with no table installed. */
bool sdq_take_batch_error(char * buf, size_t len);

/* Install (or, with NULL, remove) the hook table. The table must outlive every
 * model loaded while it is installed. */
void sdq_set_hooks(const struct sdq_hooks * hooks);

/* The installed table, or NULL. */
const struct sdq_hooks * sdq_get_hooks(void);

/* True if `t` lives in the installed table's paged buffer type. */
bool sdq_is_paged_tensor(const struct ggml_tensor * t);

/* Scratch bytes (64-byte aligned by the caller) that sdq_expert_tiled needs
 * for experts of paged weight `weight`; 0 when ggml-cpu's tiled kernel cannot
 * take its type here. */
size_t sdq_expert_tiled_scratch(const struct ggml_tensor * weight);

/* Multiplies one expert of paged weight `weight` (its type and rows), whose
 * bytes are at `data`, for `n_rows` routed rows with ggml-cpu's tiled kernel,
 * on the calling thread alone. Routed row i is the pair (k, t) = (rows[2i],
 * rows[2i+1]): it multiplies activation row t*b_ne1 + k%b_ne1 of
 * `activations` (converted to the weight's vec_dot type, stock's mul_mat_id
 * layout) into the floats at out + k*out_nb1 + t*out_nb2 (bytes). Returns
 * false, computing nothing, where stock would not take the tiled kernel
 * either (type, fewer than 8 rows, GGML_CPU_TILED_MM=0). */
bool sdq_expert_tiled(const struct ggml_tensor * weight, const void * data,
                      int64_t b_ne1, const void * activations, size_t activations_size,
                      int64_t n_rows, const int32_t * rows,
                      float * out, size_t out_nb1, size_t out_nb2, void * scratch);

/* y = silu(gate) * up over n values: ggml-cpu's SwiGLU row kernel. */
void sdq_swiglu(int n, float * y, const float * gate, const float * up);

/* What a weight buffer type means for a paged weight's layout. */
enum sdq_buft_kind {
    SDQ_BUFT_CPU = 0,        /* ggml-cpu's plain buffer: the file's layout */
    SDQ_BUFT_CPU_REPACK = 1, /* ggml-cpu's CPU_REPACK: interleaved, if it takes the weight */
    SDQ_BUFT_OTHER = 2,      /* anything else (AMX, KleidiAI, another device) */
};
int sdq_buft_layout(ggml_backend_buffer_type_t buft);

/* The layout ggml-cpu's CPU_REPACK buffer type gives an expert of `weight`
 * (its type and [ne0, ne1]): a kernel id >= 0 for the functions below; -1
 * if it leaves such a weight plain (type, CPU features or row count); -2 if
 * it repacks it into a layout sdq cannot reproduce. */
int sdq_repack_kernel(const struct ggml_tensor * weight);

/* Whether sdq converts into `kernel`'s layout with its own faster routine:
 * 1 (it gave ggml's bytes for a sample expert), 0 (there is none: ggml's
 * routine converts), -1 (it differed, so ggml's routine converts). */
int sdq_repack_fast(int kernel);

/* The kernel's name as ggml-cpu spells the layout ("q4_K_8x8_q8_K"). */
const char * sdq_repack_kernel_name(int kernel);

/* Converts one expert (ne1 rows of ne0 values of the kernel's type at
 * `data`) in place into `kernel`'s layout, with ggml-cpu's own repack
 * routine. False, with the bytes undefined, if the routine refuses them. */
bool sdq_repack_expert(int kernel, int64_t ne0, int64_t ne1, void * data);

/* Multiplies one repacked expert (ne1 rows of ne0 values) at `data` for `n_rows` routed
 * rows, as stock's repacked mul_mat_id does with `nth` threads: the same
 * GEMV calls over the same weight-row ranges, on the calling thread.
 * Routed row i is (k, t) = (rows[2i], rows[2i+1]): activation row
 * t*b_ne1 + k%b_ne1 of `activations` (rows of activation_row_bytes,
 * converted to the weight's vec_dot type) into the floats at
 * out + k*out_nb1 + t*out_nb2 (bytes). */
void sdq_repack_mul(int kernel, int64_t ne0, int64_t ne1, const void * data,
                    int64_t b_ne1, const void * activations, size_t activation_row_bytes,
                    int64_t n_rows, const int32_t * rows,
                    float * out, size_t out_nb1, size_t out_nb2, int nth);

/* Drops [offset, offset+length) of file `fd` from the page cache (where the
 * platform allows). */
void sdq_drop_cached(int fd, uint64_t offset, uint64_t length);

/* The bytes a projector (`--mmproj` file) takes once loaded on the CPU:
 * weights plus the compute buffers mtmd reserves for its largest input,
 * from the file's metadata (mtmd_get_memory_usage; nothing is loaded).
 * Returns 0 and sets *total, or 1 if mtmd cannot read the file. */
int sdq_mtmd_memory(const char * mmproj_path, int n_threads, uint64_t * total);

/* The compute buffers a context of `model_path` with these sizes uses in
 * host memory for a full ubatch asking one output (see compute_buffers),
 * from the file's metadata (the model is loaded with no_alloc: no tensor
 * data is read). Returns 0 and sets *bytes, or 1 on failure. */
int sdq_context_compute_bytes(const char * model_path, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch, uint64_t * bytes);

#ifdef __cplusplus
}

#include <string>

/* sdq_report as a string ("" with no table installed). */
inline std::string sdq_report_string(int kind) {
    // The figures may grow between the two calls; the slack keeps them whole.
    std::string s(sdq_report(kind, nullptr, 0) + 256, '\0');
    size_t n = sdq_report(kind, &s[0], s.size());
    s.resize(n < s.size() ? n : s.size() - 1);
    return n == 0 ? std::string() : s;
}
#endif

#endif /* SDQ_HOOKS_H */
