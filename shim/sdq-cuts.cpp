// A tool's checkpoints taken inside one llama_decode: see sdq-cuts.h.

#include "sdq-cuts.h"
#include "sdq-pieces.h"

#include "llama-io.h"

#include "ggml-backend.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <unordered_map>

// One plan a context: set by the tool before a decode, taken after it. A
// tool decodes a context from one thread at a time, but two contexts may
// decode at once.
static std::mutex plans_mutex;
static std::unordered_map<const llama_context *, std::unique_ptr<sdq_cut_plan>> plans;

void sdq_cuts_set(llama_context * ctx, llama_seq_id seq, llama_state_seq_flags flags, const std::vector<int32_t> & at,
                  const std::vector<int32_t> & take_at) {
    auto plan = std::make_unique<sdq_cut_plan>();
    plan->cut_at = at;
    plan->take_at = take_at;
    plan->seq_id = seq;
    plan->state_flags = flags;
    std::lock_guard<std::mutex> lock(plans_mutex);
    plans[ctx] = std::move(plan);
}

bool sdq_cuts_take(llama_context * ctx, int32_t at, std::vector<uint8_t> & data, llama_pos & pos_min, llama_pos & pos_max) {
    std::lock_guard<std::mutex> lock(plans_mutex);
    auto it = plans.find(ctx);
    if (it == plans.end() || !it->second->active || it->second->failed) {
        return false;
    }
    auto & states = it->second->states;
    auto s = std::find_if(states.begin(), states.end(), [&](const sdq_cut_plan::state & s) { return s.at == at && s.pending.empty(); });
    if (s == states.end()) {
        return false;
    }
    data = std::move(s->data);
    pos_min = s->pos_min;
    pos_max = s->pos_max;
    states.erase(s);
    return true;
}

void sdq_cuts_clear(llama_context * ctx) {
    std::lock_guard<std::mutex> lock(plans_mutex);
    plans.erase(ctx);
}

// One progress a context, set before a decode and taken by it.
static std::unordered_map<const llama_context *, std::function<void(int32_t, int32_t)>> progresses;

void sdq_progress_set(llama_context * ctx, std::function<void(int32_t, int32_t)> progress) {
    std::lock_guard<std::mutex> lock(plans_mutex);
    progresses[ctx] = std::move(progress);
}

std::function<void(int32_t, int32_t)> sdq_progress_take(llama_context * ctx) {
    std::lock_guard<std::mutex> lock(plans_mutex);
    auto it = progresses.find(ctx);
    if (it == progresses.end()) {
        return {};
    }
    auto progress = std::move(it->second);
    progresses.erase(it);
    return progress;
}

sdq_cut_plan * sdq_cut_plan::begin(llama_context * ctx, llama_seq_id seq, int32_t n_tokens) {
    std::lock_guard<std::mutex> lock(plans_mutex);
    auto it = plans.find(ctx);
    if (it == plans.end() || it->second->active) {
        return nullptr; // none set, or set for an earlier decode
    }
    sdq_cut_plan & plan = *it->second;
    plan.active = true;
    bool fits = plan.seq_id == seq && !plan.cut_at.empty();
    for (size_t i = 0; fits && i < plan.cut_at.size(); ++i) {
        fits = plan.cut_at[i] > 0 && plan.cut_at[i] < n_tokens && (i == 0 || plan.cut_at[i] > plan.cut_at[i - 1]);
    }
    for (int32_t at : plan.take_at) {
        fits = fits && std::binary_search(plan.cut_at.begin(), plan.cut_at.end(), at);
    }
    if (!fits) {
        plan.failed = true;
        return nullptr;
    }
    return &plan;
}

uint32_t sdq_cut_plan::n_ubatches(uint32_t n_tokens, uint32_t n_ubatch) const {
    uint32_t n = 0;
    uint32_t from = 0;
    for (size_t i = 0; i <= cut_at.size(); ++i) {
        const uint32_t to = i < cut_at.size() ? (uint32_t) cut_at[i] : n_tokens;
        n += (to - from + n_ubatch - 1) / n_ubatch;
        from = to;
    }
    return n;
}

namespace {
// Writes a state's bytes, recording where each tensor's bytes go instead of
// reading them.
class recording_io : public llama_io_write_i {
public:
    explicit recording_io(sdq_cut_plan::state & s) : s(s) {}

    void write(const void * src, size_t size) override {
        const auto * p = static_cast<const uint8_t *>(src);
        s.data.insert(s.data.end(), p, p + size);
    }

    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        s.pending.push_back({ tensor, offset, size, s.data.size() });
        s.data.resize(s.data.size() + size);
    }

    size_t n_bytes() override { return s.data.size(); }

private:
    sdq_cut_plan::state & s;
};

void read_tensor(sdq_cut_plan::state & s, const sdq_cut_plan::deferred & d) {
    ggml_backend_tensor_get(d.tensor, s.data.data() + d.out, d.offset, d.size);
}
} // namespace

bool sdq_cut_plan::takes_at(int32_t first) const {
    return std::find(take_at.begin(), take_at.end(), first) != take_at.end();
}

void sdq_cut_plan::take_at_ubatch(int32_t first, bool staged, const std::function<void(llama_io_write_i &)> & write, llama_pos pos_min, llama_pos pos_max) {
    states.emplace_back();
    state & s = states.back();
    s.at = first;
    s.pos_min = pos_min;
    s.pos_max = pos_max;
    recording_io io(s);
    write(io);
    if (!staged) {
        for (const auto & d : s.pending) {
            read_tensor(s, d);
        }
        s.pending.clear();
    }
}

void sdq_cut_plan::before_piece(int32_t first, const sdq_graph_pieces & pieces) {
    for (auto & s : states) {
        if (s.at != first || s.pending.empty()) {
            continue;
        }
        const int next = (int) pieces.n_done();
        auto keep = s.pending.begin();
        for (auto & d : s.pending) {
            if (d.piece == -2) {
                d.piece = pieces.piece_writing(d.tensor);
            }
            if (d.piece >= 0 && d.piece <= next) {
                read_tensor(s, d);
            } else {
                *keep++ = d;
            }
        }
        s.pending.erase(keep, s.pending.end());
    }
}

void sdq_cut_plan::read_all() {
    for (auto & s : states) {
        for (const auto & d : s.pending) {
            read_tensor(s, d);
        }
        s.pending.clear();
    }
}

void sdq_cut_plan::fail() {
    failed = true;
}
