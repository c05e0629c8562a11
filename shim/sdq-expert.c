// One expert of a paged expert matmul through ggml-cpu's tiled K-quant
// kernel: the kernel stock's mul_mat_id uses for an expert that a batch
// gives 8 or more rows. Compiled into libggml-cpu, whose internal
// ggml_compute_params it needs; declared in sdq-hooks.h.
#include "sdq-hooks.h"

#include "ggml-cpu-impl.h"
#include "tiled/tiled.h"

#include <string.h>

size_t sdq_expert_tiled_scratch(const struct ggml_tensor * dst) {
    // Stock reserves ggml_tiled_wdata_size(n_tasks) = 64 bytes of alignment
    // slack plus one workspace per task; one task here, aligned by the caller.
    size_t size = ggml_tiled_wdata_size(1, (struct ggml_tensor *) dst);
    return size > 64 ? size - 64 : 0;
}

bool sdq_expert_tiled(const struct ggml_tensor * dst, const void * weights,
                      const void * activations, size_t activations_size,
                      int64_t n_rows, const int32_t * rows, void * scratch) {
    // The expert as the only matrix of a copy of the weight tensor, so the
    // kernel reads expert 0 at `weights`; extra is cleared because the kernel
    // leaves weights with extra data (repacked layouts) to other kernels.
    struct ggml_tensor weight = *dst->src[0];
    weight.data = (void *) weights;
    weight.ne[2] = 1;
    weight.extra = NULL;
    struct ggml_tensor op = *dst;
    op.src[0] = &weight;

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
    return ggml_compute_forward_mul_mat_id_tiled(&params, &op, 0, n_rows, rows, (char *) scratch);
}
