// One ubatch's graph computed a piece at a time: see sdq-pieces.h.

#include "sdq-pieces.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <unordered_map>

// The tensor whose memory `t` is (a view's, followed to its source).
static const ggml_tensor * memory_of(const ggml_tensor * t) {
    while (t->view_src) {
        t = t->view_src;
    }
    return t;
}

static ggml_tensor * memory_of(ggml_tensor * t) {
    return const_cast<ggml_tensor *>(memory_of(static_cast<const ggml_tensor *>(t)));
}

// In the compute buffer, whose memory the allocator hands from tensor to
// tensor; weights, the KV cache and recurrent state live elsewhere.
static bool in_compute_buffer(const ggml_tensor * t) {
    return t->data && t->buffer && ggml_backend_buffer_get_usage(t->buffer) == GGML_BACKEND_BUFFER_USAGE_COMPUTE;
}

sdq_graph_pieces::~sdq_graph_pieces() {
    if (view_ctx) {
        ggml_free(view_ctx);
    }
}

void sdq_graph_pieces::init(ggml_cgraph * graph, int (*layer_of)(void *, const ggml_tensor *), void * user_data) {
    gf = graph;
    const int n = ggml_graph_n_nodes(gf);
    starts = {0};
    layers = {-1};

    // When each tensor's memory is written (-1: before the graph, an input)
    // and last read or written (INT_MAX: kept as an output), in the order
    // first seen.
    struct span { int written; int last; };
    std::unordered_map<ggml_tensor *, span> spans;
    std::vector<ggml_tensor *> seen;
    auto touch = [&](ggml_tensor * t, int i, bool writes) {
        ggml_tensor * m = memory_of(t);
        auto it = spans.find(m);
        if (it == spans.end()) {
            it = spans.emplace(m, span{ writes && m == t ? i : -1, i }).first;
            seen.push_back(m);
        }
        it->second.last = std::max(it->second.last, i);
        if ((t->flags & GGML_TENSOR_FLAG_OUTPUT) || (m->flags & GGML_TENSOR_FLAG_OUTPUT)) {
            it->second.last = INT_MAX;
        }
    };

    int layer = -1;
    for (int i = 0; i < n; ++i) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        const int l = layer_of(user_data, node);
        if (l >= 0 && l != layer) {
            starts.push_back(i);
            layers.push_back(l);
            layer = l;
        }
        for (ggml_tensor * src : node->src) {
            if (src) {
                touch(src, i, false);
            }
        }
        touch(node, i, true);
    }

    op_out = 0;
    for (size_t k = 1; k < starts.size(); ++k) {
        op_out = std::max(op_out, ggml_nbytes(ggml_graph_node(gf, starts[k])));
    }

    crossing.assign(starts.size() + 1, {});
    most = 0;
    for (size_t k = 0; k <= starts.size(); ++k) {
        const int cut = k < starts.size() ? starts[k] : n;
        auto & across = crossing[k];
        for (ggml_tensor * m : seen) {
            const span & s = spans[m];
            if (in_compute_buffer(m) && s.written < cut && s.last >= cut) {
                across.push_back(m);
            }
        }
        // Back in the order written: where the allocator gave a dead
        // tensor's memory to a later one, the later one's bytes win.
        std::stable_sort(across.begin(), across.end(), [&](ggml_tensor * a, ggml_tensor * b) {
            return spans[a].written < spans[b].written;
        });
        size_t bytes = 0;
        for (ggml_tensor * m : across) {
            bytes += ggml_nbytes(m);
        }
        most = std::max(most, bytes);
    }

    view_bytes = ggml_graph_overhead_custom(n, false);
    view_ctx = ggml_init({ view_bytes, nullptr, true });
    view = ggml_new_graph_custom(view_ctx, n, false);
    next = 0;
}

void sdq_graph_pieces::keep_inputs() {
    kept.reserve(most);
    keep(0);
}

ggml_tensor * sdq_graph_pieces::op_of_piece(size_t k) const {
    return ggml_graph_node(gf, starts[k]);
}

const void * sdq_graph_pieces::kept_data(const ggml_tensor * t) const {
    const ggml_tensor * m = memory_of(t);
    size_t offs = 0;
    for (const ggml_tensor * c : crossing[next]) {
        if (c == m) {
            return kept.data() + offs + ((const uint8_t *) t->data - (const uint8_t *) m->data);
        }
        offs += ggml_nbytes(c);
    }
    return nullptr;
}

int sdq_graph_pieces::piece_writing(const ggml_tensor * t) const {
    const ggml_tensor * m = memory_of(t);
    const int n = ggml_graph_n_nodes(gf);
    for (int i = 0; i < n; ++i) {
        const ggml_tensor * node = ggml_graph_node(gf, i);
        // a view only names memory; the op that returns it writes it (the
        // ops ggml-impl.h's ggml_op_is_empty names, which libllama cannot see)
        const bool view = node->op == GGML_OP_VIEW || node->op == GGML_OP_RESHAPE || node->op == GGML_OP_PERMUTE ||
                          node->op == GGML_OP_TRANSPOSE || node->op == GGML_OP_NONE;
        if (!view && memory_of(node) == m) {
            return (int) (std::upper_bound(starts.begin(), starts.end(), i) - starts.begin()) - 1;
        }
    }
    return -1;
}

void sdq_graph_pieces::keep(size_t cut) {
    kept.clear();
    for (ggml_tensor * m : crossing[cut]) {
        const uint8_t * p = (const uint8_t *) m->data;
        kept.insert(kept.end(), p, p + ggml_nbytes(m));
    }
}

void sdq_graph_pieces::restore(size_t cut) {
    size_t offs = 0;
    for (ggml_tensor * m : crossing[cut]) {
        const size_t bytes = ggml_nbytes(m);
        memcpy(m->data, kept.data() + offs, bytes);
        offs += bytes;
    }
}

ggml_status sdq_graph_pieces::compute_next(ggml_backend_t backend) {
    const size_t k = next;
    const int end = k + 1 < starts.size() ? starts[k + 1] : ggml_graph_n_nodes(gf);
    restore(k);
    ggml_graph_clear(view);
    for (int i = starts[k]; i < end; ++i) {
        ggml_graph_add_node(view, ggml_graph_node(gf, i));
    }
    const ggml_status status = ggml_backend_graph_compute(backend, view);
    if (status != GGML_STATUS_SUCCESS) {
        return status;
    }
    ++next;
    keep(next);
    return status;
}
