// The memory a vision/audio projector takes once it is loaded: its weights
// and the compute buffers mtmd reserves for its largest input, read from the
// file's metadata by mtmd itself (no tensor data is read). sdq counts both
// before it sizes the arena, which the tools do when the text model is
// loaded, before the projector.

#include "sdq-hooks.h"
#include "mtmd.h"

extern "C" int sdq_mtmd_memory(const char * mmproj_path, int n_threads, uint64_t * total) {
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
}
