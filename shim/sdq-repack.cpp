// ggml-cpu's repacked expert layouts, for paged experts: which layout stock's
// CPU_REPACK buffer type gives a weight, the conversion of one expert into it
// (ggml-cpu's own repack routine), and the GEMV stock's repacked mul_mat_id
// multiplies it with, over the same column ranges. Compiled into libggml-cpu,
// whose internal headers these need; declared in sdq-hooks.h.
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#include "sdq-hooks.h"

#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "repack.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

// The repack routines and GEMVs of repack.cpp are explicit specializations of
// these templates (external linkage); declaring the ones used here lets this
// file call exactly the functions stock's repacked tensors use.
namespace ggml::cpu::repack {
template <typename BLOC_TYPE, int64_t INTER_SIZE, int64_t NB_COLS>
int repack(struct ggml_tensor *, const void *, size_t);
template <typename BLOC_TYPE, int64_t INTER_SIZE, int64_t NB_COLS, ggml_type PARAM_TYPE>
void gemv(int, float *, size_t, const void *, const void *, int, int);

#define SDQ_DECLARE(B, I, C, P)                                                          \
    template <> int repack<B, I, C>(struct ggml_tensor *, const void *, size_t);        \
    template <> void gemv<B, I, C, P>(int, float *, size_t, const void *, const void *, int, int);
SDQ_DECLARE(block_q1_0, 4, 4, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_q1_0, 8, 4, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_q4_0, 4, 4, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_q4_0, 8, 4, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_q4_0, 8, 8, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_q4_K, 4, 8, GGML_TYPE_Q8_K)
SDQ_DECLARE(block_q4_K, 8, 8, GGML_TYPE_Q8_K)
SDQ_DECLARE(block_q5_K, 4, 8, GGML_TYPE_Q8_K)
SDQ_DECLARE(block_q5_K, 8, 8, GGML_TYPE_Q8_K)
SDQ_DECLARE(block_q6_K, 4, 8, GGML_TYPE_Q8_K)
SDQ_DECLARE(block_q6_K, 8, 8, GGML_TYPE_Q8_K)
SDQ_DECLARE(block_q2_K, 8, 8, GGML_TYPE_Q8_K)
SDQ_DECLARE(block_iq4_nl, 4, 4, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_iq4_nl, 8, 8, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_mxfp4, 4, 4, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_mxfp4, 8, 8, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_q8_0, 4, 4, GGML_TYPE_Q8_0)
SDQ_DECLARE(block_q8_0, 8, 4, GGML_TYPE_Q8_0)
#undef SDQ_DECLARE
}  // namespace ggml::cpu::repack

namespace {

// Q4_K rows, 8 at a time, into the 8-row, 8-byte-interleaved layout of
// q4_K_8x8_q8_K, the layout of every Q4_K expert of a Q4_K_M model on x86.
// ggml's routine for it copies each 8-byte run with a memcpy of a run-time
// length: about 1.7 GB/s here, which at a 2 GiB budget (every expert read
// anew each token) took a third of the CPU. This one writes the same bytes
// several times faster; identify() uses it only after it has produced ggml's
// exact bytes for a whole sample expert.
//
// Layout of one output block (8 source blocks, one per row r): the 8 d's,
// the 8 dmin's, then for each sub-block g (of 8) 12 bytes holding the 8
// rows' 6-bit scales s and mins m: bytes 0-3 are s[0..3] with bits 4-5 of
// s[4..7] on top, bytes 4-7 the same for m, bytes 8-11 the low nibbles of
// s[4..7] and m[4..7]; then the quants, 8 bytes of row r's run j at
// position 8·j + r.
void repack_q4_K_8x8_group(const block_q4_K * in, int64_t nblocks, block_q4_Kx8 * out) {
    for (int64_t x = 0; x < nblocks; x++) {
        block_q4_Kx8 & o = out[x];
        uint8_t sc[8][8], mn[8][8];  // [row][sub-block]
        for (int r = 0; r < 8; r++) {
            const block_q4_K & b = in[r * nblocks + x];
            o.d[r] = b.GGML_COMMON_AGGR_U.GGML_COMMON_AGGR_S.d;
            o.dmin[r] = b.GGML_COMMON_AGGR_U.GGML_COMMON_AGGR_S.dmin;
            const uint8_t * q = b.scales;
            for (int g = 0; g < 4; g++) {
                sc[r][g] = q[g] & 63;
                mn[r][g] = q[g + 4] & 63;
                sc[r][g + 4] = (q[g + 8] & 15) | ((q[g] >> 6) << 4);
                mn[r][g + 4] = (q[g + 8] >> 4) | ((q[g + 4] >> 6) << 4);
            }
            for (int j = 0; j < 16; j++) {
                std::memcpy(o.qs + 8 * (8 * j + r), b.qs + 8 * j, 8);
            }
        }
        for (int g = 0; g < 8; g++) {
            uint8_t * p = o.scales + 12 * g;
            for (int r = 0; r < 4; r++) {
                p[r] = (uint8_t) (sc[r][g] | ((sc[r + 4][g] & 48) << 2));
                p[4 + r] = (uint8_t) (mn[r][g] | ((mn[r + 4][g] & 48) << 2));
                p[8 + r] = (uint8_t) ((sc[r + 4][g] & 15) | ((mn[r + 4][g] & 15) << 4));
            }
        }
    }
}

// Q2_K rows, 8 at a time, into q2_K_8x8_q8_K, the layout of Q2_K experts
// on x86 with AVX-512 (DeepSeek's Q2_K mixes). ggml's routine builds each
// output block on the stack from a copy of its 8 input blocks and moves
// the scales a byte at a time: 3.0 GB/s here, against 8.8 for this one
// (a 4.8 MB DeepSeek-V3 part, from memory), which writes the same bytes.
//
// Layout of one output block (8 source blocks, one per row r): the 8 d's,
// the 8 dmin's, then for each pair of sub-blocks g (of 8) 16 bytes holding
// row r's two scale bytes at 2·r; then the quants, 8 bytes of row r's run
// j at position 8·j + r.
void repack_q2_K_8x8_group(const block_q2_K * in, int64_t nblocks, block_q2_Kx8 * out) {
    for (int64_t x = 0; x < nblocks; x++) {
        block_q2_Kx8 & o = out[x];
        for (int r = 0; r < 8; r++) {
            const block_q2_K & b = in[r * nblocks + x];
            o.d[r] = b.GGML_COMMON_AGGR_U.GGML_COMMON_AGGR_S.d;
            o.dmin[r] = b.GGML_COMMON_AGGR_U.GGML_COMMON_AGGR_S.dmin;
            for (int g = 0; g < 8; g++) {
                std::memcpy(o.scales + 16 * g + 2 * r, b.scales + 2 * g, 2);
            }
            for (int j = 0; j < 8; j++) {
                std::memcpy(o.qs + 8 * (8 * j + r), b.qs + 8 * j, 8);
            }
        }
    }
}

// sdq's conversion of a K-quant weight of `TYPE` into its 8x8 layout,
// one group of 8 rows at a time (`GROUP`); -1 for a weight that is not
// whole groups of whole blocks of `TYPE`. `data` must not be `t->data`: a row
// group's output overwrites its later blocks' input (sdq_repack_expert
// gives a scratch copy of the rows).
template <typename In, typename Out, ggml_type TYPE, void (*GROUP)(const In *, int64_t, Out *)>
int repack_K_8x8_fast(struct ggml_tensor * t, const void * data, size_t data_size) {
    const int64_t nblocks = t->ne[0] / QK_K, nrow = t->ne[1];
    if (t->type != TYPE || nrow % 8 != 0 || t->ne[0] % QK_K != 0 ||
        data_size != (size_t) (nrow * nblocks) * sizeof(In)) {
        return -1;
    }
    const In * src = (const In *) data;
    Out * dst = (Out *) t->data;
    for (int64_t b = 0; b < nrow; b += 8) {
        GROUP(src + b * nblocks, nblocks, dst + (b / 8) * nblocks);
    }
    return 0;
}

// One of repack.cpp's layouts (its tensor_traits<BLOC_TYPE, INTER_SIZE,
// NB_COLS, PARAM_TYPE> instances outside RISC-V).
struct Kernel {
    const char * name;
    ggml_type type;
    int64_t nb_cols;     // rows interleaved together
    ggml_type param;     // the activations' type
    int (*repack)(struct ggml_tensor *, const void *, size_t);
    void (*gemv)(int, float *, size_t, const void *, const void *, int, int);
    // sdq's faster conversion into the same layout, if it has one: used once
    // it has given ggml's bytes for a sample (see identify).
    int (*fast)(struct ggml_tensor *, const void *, size_t);
};

#define SDQ_KERNEL(NAME, B, T, I, C, P) \
    { NAME, T, C, P, &ggml::cpu::repack::repack<B, I, C>, &ggml::cpu::repack::gemv<B, I, C, P>, nullptr }
const Kernel KERNELS[] = {
    SDQ_KERNEL("q1_0_4x4_q8_0", block_q1_0, GGML_TYPE_Q1_0, 4, 4, GGML_TYPE_Q8_0),
    SDQ_KERNEL("q1_0_4x8_q8_0", block_q1_0, GGML_TYPE_Q1_0, 8, 4, GGML_TYPE_Q8_0),
    SDQ_KERNEL("q4_0_4x4_q8_0", block_q4_0, GGML_TYPE_Q4_0, 4, 4, GGML_TYPE_Q8_0),
    SDQ_KERNEL("q4_0_4x8_q8_0", block_q4_0, GGML_TYPE_Q4_0, 8, 4, GGML_TYPE_Q8_0),
    SDQ_KERNEL("q4_0_8x8_q8_0", block_q4_0, GGML_TYPE_Q4_0, 8, 8, GGML_TYPE_Q8_0),
    SDQ_KERNEL("q4_K_8x4_q8_K", block_q4_K, GGML_TYPE_Q4_K, 4, 8, GGML_TYPE_Q8_K),
    { "q4_K_8x8_q8_K", GGML_TYPE_Q4_K, 8, GGML_TYPE_Q8_K, &ggml::cpu::repack::repack<block_q4_K, 8, 8>,
      &ggml::cpu::repack::gemv<block_q4_K, 8, 8, GGML_TYPE_Q8_K>, &repack_K_8x8_fast<block_q4_K, block_q4_Kx8, GGML_TYPE_Q4_K, repack_q4_K_8x8_group> },
    SDQ_KERNEL("q5_K_8x4_q8_K", block_q5_K, GGML_TYPE_Q5_K, 4, 8, GGML_TYPE_Q8_K),
    SDQ_KERNEL("q5_K_8x8_q8_K", block_q5_K, GGML_TYPE_Q5_K, 8, 8, GGML_TYPE_Q8_K),
    SDQ_KERNEL("q6_K_8x4_q8_K", block_q6_K, GGML_TYPE_Q6_K, 4, 8, GGML_TYPE_Q8_K),
    SDQ_KERNEL("q6_K_8x8_q8_K", block_q6_K, GGML_TYPE_Q6_K, 8, 8, GGML_TYPE_Q8_K),
    { "q2_K_8x8_q8_K", GGML_TYPE_Q2_K, 8, GGML_TYPE_Q8_K, &ggml::cpu::repack::repack<block_q2_K, 8, 8>,
      &ggml::cpu::repack::gemv<block_q2_K, 8, 8, GGML_TYPE_Q8_K>, &repack_K_8x8_fast<block_q2_K, block_q2_Kx8, GGML_TYPE_Q2_K, repack_q2_K_8x8_group> },
    SDQ_KERNEL("iq4_nl_4x4_q8_0", block_iq4_nl, GGML_TYPE_IQ4_NL, 4, 4, GGML_TYPE_Q8_0),
    SDQ_KERNEL("iq4_nl_8x8_q8_0", block_iq4_nl, GGML_TYPE_IQ4_NL, 8, 8, GGML_TYPE_Q8_0),
    SDQ_KERNEL("mxfp4_4x4_q8_0", block_mxfp4, GGML_TYPE_MXFP4, 4, 4, GGML_TYPE_Q8_0),
    SDQ_KERNEL("mxfp4_8x8_q8_0", block_mxfp4, GGML_TYPE_MXFP4, 8, 8, GGML_TYPE_Q8_0),
    SDQ_KERNEL("q8_0_4x4_q8_0", block_q8_0, GGML_TYPE_Q8_0, 4, 4, GGML_TYPE_Q8_0),
    SDQ_KERNEL("q8_0_4x8_q8_0", block_q8_0, GGML_TYPE_Q8_0, 8, 4, GGML_TYPE_Q8_0),
};
#undef SDQ_KERNEL
constexpr int N_KERNELS = (int) (sizeof(KERNELS) / sizeof(KERNELS[0]));

// Per kernel: its fast conversion gave ggml's bytes (set by identify).
std::atomic<bool> FAST_CHECKED[N_KERNELS];

// Rows converted per call of a repack routine: a multiple of every layout's
// interleave, so each call takes whole row groups, whose converted bytes
// replace exactly their own (a group's output is as long as its input).
constexpr int64_t CHUNK_ROWS = 64;

// A standalone tensor of `type` and shape [ne0, ne1] (one expert) at `data`.
ggml_tensor expert_tensor(ggml_type type, int64_t ne0, int64_t ne1, void * data) {
    ggml_tensor t;
    std::memset(&t, 0, sizeof(t));
    t.type = type;
    t.ne[0] = ne0;
    t.ne[1] = ne1;
    t.ne[2] = 1;
    t.ne[3] = 1;
    t.nb[0] = ggml_type_size(type);
    t.nb[1] = ggml_row_size(type, ne0);
    t.nb[2] = t.nb[1] * ne1;
    t.nb[3] = t.nb[2];
    t.data = data;
    return t;
}

// Which kernel stock's CPU_REPACK buffer gives experts of `type` with
// [ne0, ne1] rows: -1 if it leaves them plain, -2 if its layout is none of
// KERNELS. Found by converting one sample expert (ggml's quantizer on a
// fixed pattern) through stock's own buffer and through each candidate:
// the candidate whose bytes are stock's is the layout.
int identify(ggml_type type, int64_t ne0, int64_t ne1) {
    ggml_backend_buffer_type_t buft = ggml_backend_cpu_repack_buffer_type();
    const size_t bytes = ggml_row_size(type, ne0) * ne1;
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, bytes);
    if (buf == nullptr) {
        return -2;
    }
    ggml_tensor stock = expert_tensor(type, ne0, ne1, nullptr);
    // Stock's choice for this tensor: what its loader's init_tensor records.
    int kernel = -1;
    if (ggml_backend_tensor_alloc(buf, &stock, ggml_backend_buffer_get_base(buf)) == GGML_STATUS_SUCCESS && stock.extra != nullptr) {
        kernel = -2;
        std::vector<float> values(ne0 * ne1);
        uint32_t state = 0x2545f491u;
        for (float & v : values) {
            state = state * 1664525u + 1013904223u;
            v = (float) (int32_t) (state >> 8) / (float) (1 << 23);
        }
        std::vector<uint8_t> plain(bytes), mine(bytes);
        if (!ggml_quantize_requires_imatrix(type) &&
            ggml_quantize_chunk(type, values.data(), plain.data(), 0, ne1, ne0, nullptr) == bytes) {
            ggml_backend_tensor_set(&stock, plain.data(), 0, bytes);
            const ggml_type vec_dot_type = ggml_get_type_traits_cpu(type)->vec_dot_type;
            for (int k = 0; k < N_KERNELS && kernel == -2; k++) {
                const Kernel & K = KERNELS[k];
                if (K.type != type || ne1 % K.nb_cols != 0 || K.param != vec_dot_type) {
                    continue;
                }
                ggml_tensor t = expert_tensor(type, ne0, ne1, mine.data());
                if (K.repack(&t, plain.data(), bytes) == 0 && std::memcmp(mine.data(), stock.data, bytes) == 0) {
                    kernel = k;
                    // The fast conversion must give the same bytes, from the
                    // quantized sample and from random bytes (every bit of
                    // every scale byte set both ways somewhere).
                    if (K.fast != nullptr) {
                        bool same = true;
                        for (int pass = 0; pass < 2 && same; pass++) {
                            if (pass == 1) {
                                for (uint8_t & b : plain) {
                                    state = state * 1664525u + 1013904223u;
                                    b = (uint8_t) (state >> 24);
                                }
                                ggml_backend_tensor_set(&stock, plain.data(), 0, bytes);
                            }
                            std::memset(mine.data(), 0, bytes);
                            same = K.fast(&t, plain.data(), bytes) == 0 && std::memcmp(mine.data(), stock.data, bytes) == 0;
                        }
                        FAST_CHECKED[k] = same;
                    }
                }
            }
        }
    }
    ggml_backend_buffer_free(buf);
    return kernel;
}

}  // namespace

extern "C" {

int sdq_buft_layout(ggml_backend_buffer_type_t buft) {
    if (buft == ggml_backend_cpu_buffer_type()) {
        return SDQ_BUFT_CPU;
    }
    if (buft == ggml_backend_cpu_repack_buffer_type()) {
        return SDQ_BUFT_CPU_REPACK;
    }
    return SDQ_BUFT_OTHER;
}

int sdq_repack_kernel(const struct ggml_tensor * weight) {
    // Rust calls these functions: no C++ exception may cross into it. A
    // kernel that cannot be identified (out of memory) is an unknown one:
    // the weight stays plain, and sdq says so.
    try {
        static std::mutex lock;
        static std::map<std::tuple<int, int64_t, int64_t>, int> known;
        std::lock_guard<std::mutex> guard(lock);
        const auto key = std::make_tuple((int) weight->type, weight->ne[0], weight->ne[1]);
        auto it = known.find(key);
        if (it == known.end()) {
            it = known.emplace(key, identify(weight->type, weight->ne[0], weight->ne[1])).first;
        }
        return it->second;
    } catch (...) {
        return -2;
    }
}

int sdq_repack_fast(int kernel) {
    if (kernel < 0 || kernel >= N_KERNELS || KERNELS[kernel].fast == nullptr) {
        return 0;
    }
    return FAST_CHECKED[kernel].load() ? 1 : -1;
}

const char * sdq_repack_kernel_name(int kernel) {
    return kernel >= 0 && kernel < N_KERNELS ? KERNELS[kernel].name : "plain";
}

bool sdq_repack_expert(int kernel, int64_t ne0, int64_t ne1, void * data) {
    if (kernel < 0 || kernel >= N_KERNELS) {
        return false;
    }
    const Kernel & K = KERNELS[kernel];
    const size_t row_bytes = ggml_row_size(K.type, ne0);
    thread_local std::vector<uint8_t> scratch;
    try {
        scratch.resize(row_bytes * CHUNK_ROWS);
    } catch (...) {
        return false;  // no room for the scratch rows: the conversion fails
    }
    for (int64_t r = 0; r < ne1; r += CHUNK_ROWS) {
        const int64_t n = std::min(CHUNK_ROWS, ne1 - r);
        if (n % K.nb_cols != 0) {
            return false;
        }
        uint8_t * rows = (uint8_t *) data + r * row_bytes;
        std::memcpy(scratch.data(), rows, n * row_bytes);
        ggml_tensor t = expert_tensor(K.type, ne0, n, rows);
        const auto convert = K.fast != nullptr && FAST_CHECKED[kernel].load() ? K.fast : K.repack;
        if (convert(&t, scratch.data(), n * row_bytes) != 0) {
            return false;
        }
    }
    return true;
}

void sdq_repack_mul(int kernel, int64_t ne0, int64_t ne1, const void * data,
                    int64_t b_ne1, const void * activations, size_t activation_row_bytes,
                    int64_t n_rows, const int32_t * rows,
                    float * out, size_t out_nb1, size_t out_nb2, int nth) {
    const Kernel & K = KERNELS[kernel];
    const int64_t ne00 = ne0, ne01 = ne1;
    const size_t nb01 = ggml_row_size(K.type, ne00);
    // Stock's forward_mul_mat_id: thread ith of nth multiplies the weight
    // rows [ith·ne01/nth, (ith+1)·ne01/nth), both ends rounded up to the
    // interleave, for every routed row in turn, one GEMV each. The same
    // calls in the same ranges, one range after the other.
    for (int ith = 0; ith < nth; ith++) {
        int64_t start = (ith * ne01) / nth;
        int64_t end = ((ith + 1) * ne01) / nth;
        start = (start % K.nb_cols) ? start + K.nb_cols - (start % K.nb_cols) : start;
        end = (end % K.nb_cols) ? end + K.nb_cols - (end % K.nb_cols) : end;
        end = end > ne01 ? ne01 : end;
        if (start >= end) {
            continue;
        }
        for (int64_t i = 0; i < n_rows; i++) {
            const int64_t k = rows[2 * i], t = rows[2 * i + 1];
            const char * act = (const char *) activations + (t * b_ne1 + k % b_ne1) * activation_row_bytes;
            float * dst = (float *) ((char *) out + k * out_nb1 + t * out_nb2);
            K.gemv((int) ne00, dst + start, ne01, (const char *) data + start * nb01, act, 1, (int) (end - start));
        }
    }
}

}  // extern "C"
