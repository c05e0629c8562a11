// ggml-cpu's kernels for one paged expert at a time: the tiled K-quant
// matmul stock's mul_mat_id uses for an expert that a batch gives 8 or more
// rows, and the SwiGLU row kernel. Compiled into libggml-cpu, whose internal
// headers (compute parameters, vec.h) these need; declared in sdq-hooks.h.
#include "sdq-hooks.h"

#include "ggml-cpu-impl.h"
#include "tiled/tiled.h"
#include "vec.h"

#include <string.h>

// The tensors ggml_compute_forward_mul_mat_id_tiled reads: a copy of the
// paged weight holding one expert at `data`, an F32 activation tensor of
// b_ne1 rows per token (the kernel takes its geometry; the converted rows
// come from the compute parameters), and the output.
struct tiled_op {
    struct ggml_tensor weight;
    struct ggml_tensor b;
    struct ggml_tensor dst;
};

static void tiled_op_init(struct tiled_op * op, const struct ggml_tensor * weight, const void * data,
                          int64_t b_ne1, float * out, size_t out_nb1, size_t out_nb2) {
    memset(op, 0, sizeof(*op));
    op->weight = *weight;
    op->weight.data = (void *) data;
    op->weight.ne[2] = 1;
    // extra marks weights in another kernel's layout (repacked), which the
    // tiled kernel leaves alone; a paged expert is in the file's layout.
    op->weight.extra = NULL;

    op->b.type = GGML_TYPE_F32;
    op->b.ne[0] = weight->ne[0];
    op->b.ne[1] = b_ne1;
    op->b.ne[2] = 1;
    op->b.ne[3] = 1;
    op->b.nb[0] = sizeof(float);
    op->b.nb[1] = sizeof(float) * weight->ne[0];
    op->b.nb[2] = op->b.nb[1] * b_ne1;
    op->b.nb[3] = op->b.nb[2];

    op->dst.type = GGML_TYPE_F32;
    op->dst.op = GGML_OP_MUL_MAT_ID;
    op->dst.ne[0] = weight->ne[1];
    op->dst.ne[1] = 1;
    op->dst.ne[2] = 1;
    op->dst.ne[3] = 1;
    op->dst.nb[0] = sizeof(float);
    op->dst.nb[1] = out_nb1;
    op->dst.nb[2] = out_nb2;
    op->dst.nb[3] = out_nb2;
    op->dst.data = out;
    op->dst.src[0] = &op->weight;
    op->dst.src[1] = &op->b;
}

size_t sdq_expert_tiled_scratch(const struct ggml_tensor * weight) {
    struct tiled_op op;
    tiled_op_init(&op, weight, NULL, 1, NULL, 0, 0);
    // Stock reserves 64 bytes of alignment slack plus one workspace per
    // task; one task here, aligned by the caller.
    size_t size = ggml_tiled_wdata_size(1, &op.dst);
    return size > 64 ? size - 64 : 0;
}

bool sdq_expert_tiled(const struct ggml_tensor * weight, const void * data,
                      int64_t b_ne1, const void * activations, size_t activations_size,
                      int64_t n_rows, const int32_t * rows,
                      float * out, size_t out_nb1, size_t out_nb2, void * scratch) {
    struct tiled_op op;
    tiled_op_init(&op, weight, data, b_ne1, out, out_nb1, out_nb2);

    // Task 0 of 1: the kernel splits an expert's weight rows by task, and
    // every output value comes from one window whatever the split, so one
    // thread computes exactly the bits stock's threads do together.
    struct ggml_compute_params params;
    memset(&params, 0, sizeof(params));
    params.ith = 0;
    params.nth = 1;
    params.wsize = activations_size;
    params.wdata = (void *) activations;
    params.threadpool = NULL;
    params.use_ref = false;
    return ggml_compute_forward_mul_mat_id_tiled(&params, &op.dst, 0, n_rows, rows, (char *) scratch);
}

void sdq_swiglu(int n, float * y, const float * gate, const float * up) {
    ggml_vec_swiglu_f32(n, y, gate, up);
}
