// The memory a vision/audio projector takes once it is loaded: its weights
// and the compute buffers mtmd reserves for its largest input, read from the
// file's metadata by mtmd itself (no tensor data is read). sdq counts both
// before it sizes the arena, which the tools do when the text model is
// loaded, before the projector.

#include "sdq-hooks.h"
#include "mtmd.h"

// Rust calls both functions below: no C++ exception may cross into it, so
// each fails (returns 1) instead.
extern "C" int sdq_mtmd_memory(const char * mmproj_path, int n_threads, uint64_t * total) try {
    mtmd_context_params params = mtmd_context_params_default();
    params.use_gpu = false;
    params.n_threads = n_threads;
    params.print_timings = false;
    const auto usage = mtmd_get_memory_usage(mmproj_path, params);
    if (usage.empty()) {
        return 1;
    }
    uint64_t sum = 0;
    for (const auto & kv : usage) {
        sum += kv.second;
    }
    *total = sum;
    return 0;
} catch (...) {
    return 1;
}

// The compute buffers a context of the text model uses in host memory for
// these sizes, from a model loaded with no_alloc (metadata only, as common's
// parameter fitting loads it): of what it reserves, the share a full ubatch
// asking one output places its tensors in (patch 0006), which `sdq inspect`
// counts as a run does when it plans the arena, before any of them is touched.
#include "llama.h"

#include <atomic>

namespace {

// Set while a context is made here; that context's report lands in it.
std::atomic<uint64_t *> g_one_output{nullptr};

void capture_compute_buffers(void *, const void *, size_t, size_t one_output) {
    if (uint64_t * out = g_one_output.load()) {
        *out = one_output;
    }
}

} // namespace

extern "C" int sdq_context_compute_bytes(const char * model_path, uint32_t n_ctx, uint32_t n_batch, uint32_t n_ubatch, uint64_t * bytes) try {
    llama_model_params mp = llama_model_default_params();
    mp.no_alloc = true;
    mp.load_mode = LLAMA_LOAD_MODE_NONE;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_batch;
    cp.n_ubatch = n_ubatch;
    // Only this table's report hook, for as long as the context is made:
    // the process runs no model meanwhile (sdq inspect).
    const sdq_hooks * outer = sdq_get_hooks();
    sdq_hooks table{};
    table.version = SDQ_HOOKS_VERSION;
    table.compute_buffers = capture_compute_buffers;
    uint64_t one_output = 0;
    g_one_output.store(&one_output);
    sdq_set_hooks(&table);
    llama_context * ctx = llama_init_from_model(model, cp);
    sdq_set_hooks(outer);
    g_one_output.store(nullptr);
    if (!ctx) {
        llama_model_free(model);
        return 1;
    }
    llama_free(ctx);
    llama_model_free(model);
    *bytes = one_output;
    return 0;
} catch (...) {
    return 1;
}
