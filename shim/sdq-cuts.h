/*
 * sdq-cuts.h: a tool's checkpoints of a sequence's state taken inside one
 * llama_decode, and its progress told as the decode computes (C++, inside
 * libllama; patches 0017, 0018 and 0019 use it).
 *
 * Where a prompt's memory cannot be rolled back (sliding-window attention,
 * recurrent layers), llama-server checkpoints the sequence's state at a few
 * tokens of its prompt: the last user message's start, 4 + n_ubatch tokens
 * before the end and 4 before it. Stock ends a batch at each and takes the
 * checkpoint before the next batch. Far past RAM every such batch reads the
 * experts again; instead the prompt can be one batch cut at those tokens.
 * Its ubatches end at every cut as the batches did (so they and every value
 * are the same), and at each cut the state is written as
 * llama_state_seq_get_data_ext would write it there: the cells and
 * positions before the next ubatch's memory is applied, and each cache or
 * state tensor's bytes once the last ubatch before the cut has written it
 * and before the first after it does, which in a group's layer-major order
 * is between their pieces at that tensor's layer.
 */
#pragma once

#include "llama.h"

#include <cstdint>
#include <functional>
#include <vector>

class llama_io_write_i;
class sdq_graph_pieces;
struct ggml_tensor;

/* For a tool, around one llama_decode of `ctx`. */

/* Cuts the next decode's batch (all of sequence `seq`) before each batch
 * index in `at` (ascending, each inside the batch), and at those of them
 * in `take_at` takes the sequence's state as
 * llama_state_seq_get_data_ext(ctx, ..., seq, flags) would there. Replaces
 * whatever was set or taken before. */
void sdq_cuts_set(llama_context * ctx, llama_seq_id seq, llama_state_seq_flags flags, const std::vector<int32_t> & at,
                  const std::vector<int32_t> & take_at);

/* After that decode: the state taken at batch index `at` (its bytes, and
 * the sequence's lowest and highest position then). False if it was not
 * taken whole (the decode failed, or was not the batch the cuts were set
 * for). */
bool sdq_cuts_take(llama_context * ctx, int32_t at, std::vector<uint8_t> & data, llama_pos & pos_min, llama_pos & pos_max);

/* Drops what was set or taken for `ctx`. */
void sdq_cuts_clear(llama_context * ctx);

/* Calls `progress(done, total)` as the next decode of `ctx` computes its
 * batch of `total` tokens, on the decoding thread, before the batch ends:
 * after each ubatch computed alone (`done`: the batch's tokens computed),
 * and after each piece of a group (its ubatches' tokens counted in
 * proportion to the pieces computed). A tool that shows a prompt's
 * progress between batches can show it inside one, where sdq makes a long
 * prompt one batch (patch 0019). */
void sdq_progress_set(llama_context * ctx, std::function<void(int32_t done, int32_t total)> progress);

/* For llama_context::decode: the progress set for this decode (taken: the
 * next has none unless set again), or an empty function. */
std::function<void(int32_t, int32_t)> sdq_progress_take(llama_context * ctx);

/* For llama_context::decode (patch 0017). */
class sdq_cut_plan {
public:
    /* The plan set for `ctx`, now this decode's, if it fits a batch of
     * `n_tokens` of sequence `seq`; else nullptr (and nothing is taken). */
    static sdq_cut_plan * begin(llama_context * ctx, llama_seq_id seq, int32_t n_tokens);

    /* The batch indices the ubatches end before. */
    const std::vector<int32_t> & at() const { return cut_at; }
    /* How many ubatches of up to `n_ubatch` tokens a batch of `n_tokens`
     * cut there makes. */
    uint32_t n_ubatches(uint32_t n_tokens, uint32_t n_ubatch) const;
    llama_seq_id seq() const { return seq_id; }
    llama_state_seq_flags flags() const { return state_flags; }

    /* Whether a state is taken before the ubatch starting at batch index
     * `first`. */
    bool takes_at(int32_t first) const;

    /* Before that ubatch has its memory applied: `write` writes the state
     * (the tensors' bytes are recorded, not read), with the sequence's
     * positions then; `staged` says whether ubatches before it are staged
     * but not yet computed: if not, the tensors are read now. */
    void take_at_ubatch(int32_t first, bool staged, const std::function<void(llama_io_write_i &)> & write, llama_pos pos_min, llama_pos pos_max);

    /* Before piece `pieces.n_done()` of the staged ubatch starting at batch
     * index `first` is computed: the tensors that piece writes are read for
     * a cut at `first`. */
    void before_piece(int32_t first, const sdq_graph_pieces & pieces);

    /* Once every staged ubatch is computed: the tensors still unread. */
    void read_all();

    /* The decode failed: nothing it took is whole. */
    void fail();

    struct deferred {
        ggml_tensor * tensor;
        size_t offset;
        size_t size;
        size_t out;     // where in the state's bytes
        int piece = -2; // the piece of the first ubatch after the cut that writes it (-2: not looked up)
    };

    /* A state taken, until the tool takes it away. */
    struct state {
        int32_t at = 0;
        std::vector<uint8_t> data;
        std::vector<deferred> pending;
        llama_pos pos_min = -1;
        llama_pos pos_max = -1;
    };

private:
    std::vector<state> states;
    std::vector<int32_t> cut_at;
    std::vector<int32_t> take_at;
    llama_seq_id seq_id = 0;
    llama_state_seq_flags state_flags = 0;
    bool failed = false;

    friend void sdq_cuts_set(llama_context *, llama_seq_id, llama_state_seq_flags, const std::vector<int32_t> &, const std::vector<int32_t> &);
    friend bool sdq_cuts_take(llama_context *, int32_t, std::vector<uint8_t> &, llama_pos &, llama_pos &);
    bool active = false;
};
