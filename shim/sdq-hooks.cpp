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
    if (!h || !h->paged_buft || !t || !t->buffer) {
        return false;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(t->buffer);
    // Only a weight in an RPC buffer can be paged on its node: every other
    // tensor (graph builds ask for each weight) never calls into Rust.
    return buft == h->paged_buft ||
           (h->remote_paged && sdq_rpc_buft_endpoint(buft) && h->remote_paged(h->user_data, t));
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

int32_t sdq_shared_batch(void) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->shared_batch ? h->shared_batch(h->user_data) : 0;
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

// RPC (patch 0015): ggml-rpc calls these, each a no-op without the table.

bool sdq_rpc_claim_weight(const ggml_tensor * t, const char * endpoint, sdq_rpc_claim * claim) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->rpc_claim && h->rpc_claim(h->user_data, t, endpoint, claim);
}

size_t sdq_rpc_claimed(const ggml_tensor * t, const char * endpoint, uint64_t alloc_size) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->rpc_claimed ? h->rpc_claimed(h->user_data, t, endpoint, alloc_size) : 0;
}

bool sdq_rpc_encode_op(const ggml_tensor * node, int32_t * op_params) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->rpc_encode_op && node->op == GGML_OP_CUSTOM && h->rpc_encode_op(h->user_data, node, op_params);
}

bool sdq_rpc_node_pages(const char * endpoint) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->rpc_node_pages && h->rpc_node_pages(h->user_data, endpoint);
}

void sdq_rpc_node_failed(const char * endpoint, const char * message) {
    const sdq_hooks * h = sdq_get_hooks();
    if (h && h->rpc_node_failed) {
        h->rpc_node_failed(h->user_data, endpoint, message);
    }
}

bool sdq_rpc_node_lost(const char * endpoint, const char * what, bool can_go_on) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->rpc_node_lost && h->rpc_node_lost(h->user_data, endpoint, what, can_go_on);
}

int64_t sdq_rpc_losses(void) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->rpc_losses ? h->rpc_losses(h->user_data) : -1;
}

uint64_t sdq_node_claim(const ggml_tensor * t, const sdq_rpc_claim * claim) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->node_claim ? h->node_claim(h->user_data, t, claim) : 0;
}

size_t sdq_node_weight_bytes(const ggml_tensor * t) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->node_weight_bytes ? h->node_weight_bytes(h->user_data, t) : 0;
}

bool sdq_node_bind_op(ggml_tensor * node) {
    const sdq_hooks * h = sdq_get_hooks();
    return h && h->node_bind_op && h->node_bind_op(h->user_data, node);
}

void sdq_node_buffers(uint64_t bytes) {
    const sdq_hooks * h = sdq_get_hooks();
    if (h && h->node_buffers) {
        h->node_buffers(h->user_data, bytes);
    }
}
