// The hook table behind sdq-hooks.h, compiled into libllama.
#include "sdq-hooks.h"

#include <atomic>
#include <stdexcept>

#include <fcntl.h>

static std::atomic<const sdq_hooks *> g_hooks{nullptr};

void sdq_set_hooks(const sdq_hooks * hooks) {
    g_hooks.store(hooks, std::memory_order_release);
}

const sdq_hooks * sdq_get_hooks(void) {
    return g_hooks.load(std::memory_order_acquire);
}

void sdq_drop_cached(int fd, uint64_t offset, uint64_t length) {
#ifdef POSIX_FADV_DONTNEED
    posix_fadvise(fd, (off_t) offset, (off_t) length, POSIX_FADV_DONTNEED);
#else
    (void) fd; (void) offset; (void) length;
#endif
}

bool sdq_is_paged_tensor(const ggml_tensor * t) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->paged_buft && t && t->buffer &&
           ggml_backend_buffer_get_type(t->buffer) == h->paged_buft;
}

bool sdq_abort_requested(void * data) {
    (void) data;
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->abort_requested && h->abort_requested(h->user_data);
}

size_t sdq_report(int kind, char * buf, size_t len) {
    const sdq_hooks * h = sdq_get_hooks();
    if (!h || !h->report) {
        if (buf && len > 0) {
            buf[0] = 0;
        }
        return 0;
    }
    return h->report(h->user_data, kind, buf, len);
}

bool sdq_take_batch_error(char * buf, size_t len) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->take_batch_error && h->take_batch_error(h->user_data, buf, len);
}

void sdq_check_load(void) {
    const sdq_hooks * h = sdq_get_hooks();
    char buf[2048];
    if (h && h->take_load_error && h->take_load_error(h->user_data, buf, sizeof(buf))) {
        throw std::runtime_error(buf);
    }
}
