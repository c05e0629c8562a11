/*
 * sdq-pieces.h: one ubatch's graph computed a piece at a time (C++, inside
 * libllama; patch 0013 uses it).
 *
 * A long prompt is several ubatches, and each reads every expert it routes
 * to. Computed one after the other, layer by layer across the ubatches (all
 * of layer L's pieces before any of layer L+1's), each expert is read once
 * for all of them. A piece is the run of nodes from one paged expert layer's
 * first op to the next's; ubatch k's piece reads only its own earlier
 * pieces' tensors and what the earlier ubatches wrote into the KV cache and
 * recurrent state at the same layer, so every value is the one computed in
 * stock's order.
 *
 * The ubatches' graphs take turns in one compute buffer, whose memory ggml's
 * allocator reuses once a tensor's last reader has run. So what crosses a
 * cut (the residual stream, the inputs, the routing, tensors kept as
 * outputs) is copied aside after the piece before it and back before the
 * piece after it.
 */
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

class sdq_graph_pieces {
public:
    sdq_graph_pieces() = default;
    sdq_graph_pieces(const sdq_graph_pieces &) = delete;
    sdq_graph_pieces & operator=(const sdq_graph_pieces &) = delete;
    ~sdq_graph_pieces();

    /* Cuts `gf` (allocated, its inputs set) before the first op of each
     * paged expert layer (`layer_of(node)` >= 0 names the layer); nothing
     * is kept aside yet (see `bytes`). */
    void init(ggml_cgraph * gf, int (*layer_of)(void * user_data, const ggml_tensor * node), void * user_data);

    /* Keeps the graph's inputs aside: before the first piece is computed,
     * once the caller has room for `bytes`. */
    void keep_inputs();

    size_t n_pieces() const { return starts.size(); }
    /* The pieces computed so far. */
    size_t n_done() const { return next; }
    /* The paged layer whose experts piece k (k >= 1) starts with. */
    int layer_of_piece(size_t k) const { return layers[k]; }
    /* The first op of piece k (k >= 1): its routing is computed once piece
     * k - 1 is. */
    ggml_tensor * op_of_piece(size_t k) const;

    /* Computes the next piece on `backend` (the graph allocated again in
     * the compute buffer by the caller): what crosses into it is copied
     * back first, and what crosses out of it is kept after. */
    ggml_status compute_next(ggml_backend_t backend);

    /* Once every piece is computed, puts the graph's outputs (logits,
     * embeddings) back, for reading them after other graphs took the
     * compute buffer. */
    void restore_outputs() { restore(starts.size()); }

    /* Bytes it holds once its inputs are kept: what it keeps aside at the
     * largest cut, and its view of a piece. */
    size_t bytes() const { return most + view_bytes; }

    /* The largest output of a piece's first op (an expert op): what this
     * ubatch keeps of it where another ubatch's op computes it. */
    size_t largest_op_out() const { return op_out; }

    /* Where tensor `t` (a source of the next piece's first op) is kept
     * aside, valid until that piece is computed; NULL if it does not cross
     * into the piece (it is not in the compute buffer). */
    const void * kept_data(const ggml_tensor * t) const;

    /* The piece whose nodes first write into `t`'s memory (a KV cache or
     * recurrent state tensor, or a view of one), or -1 if none does. */
    int piece_writing(const ggml_tensor * t) const;

private:
    void keep(size_t cut);
    void restore(size_t cut);

    ggml_cgraph * gf = nullptr;
    /* First node of each piece; piece 0 starts at node 0. */
    std::vector<int> starts;
    /* The paged layer each piece starts with (-1 for piece 0). */
    std::vector<int> layers;
    /* What crosses each cut (cut k is the start of piece k; cut 0's are the
     * inputs, and the last cut, after the last piece, the outputs), in the
     * order they were written. */
    std::vector<std::vector<ggml_tensor *>> crossing;
    std::vector<uint8_t> kept;
    /* The bytes crossing the largest cut. */
    size_t most = 0;
    size_t op_out = 0;
    size_t next = 0;
    ggml_context * view_ctx = nullptr;
    size_t view_bytes = 0;
    ggml_cgraph * view = nullptr;
};
