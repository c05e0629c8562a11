// Dumps what a dense model's FFN sees, for routing made from trained
// weights (scripts/trained-routing.py): each layer's FFN input (the output of
// its ffn_norm) for every token of a text, and its gate matrix as floats.
//
//   dump-ffn MODEL TEXT OUTDIR
//
// Writes OUTDIR/ffn-in-L.f32 (n_tokens rows of n_embd floats),
// OUTDIR/gate-L.f32 (n_ff rows of n_embd floats) and OUTDIR/meta.txt
// (n_layer n_embd n_ff n_tokens). Links sdq's libllama (stock behaviour:
// no SDQ_RAM_BUDGET).
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char * g_out;

static bool capture(struct ggml_tensor * t, bool ask, void * user) {
    (void) user;
    int il;
    if (sscanf(t->name, "ffn_norm-%d", &il) != 1 || t->type != GGML_TYPE_F32) {
        return !ask;  // not wanted; when not asking, go on
    }
    if (ask) {
        return true;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/ffn-in-%d.f32", g_out, il);
    FILE * f = fopen(path, "ab");
    if (!f) {
        perror(path);
        exit(1);
    }
    size_t n = (size_t) ggml_nelements(t);
    float * buf = malloc(n * sizeof(float));
    ggml_backend_tensor_get(t, buf, 0, n * sizeof(float));
    fwrite(buf, sizeof(float), n, f);
    free(buf);
    fclose(f);
    return true;
}

static char * slurp(const char * path, size_t * len) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char * s = malloc((size_t) n + 1);
    if (fread(s, 1, (size_t) n, f) != (size_t) n) {
        perror(path);
        exit(1);
    }
    s[n] = 0;
    fclose(f);
    *len = (size_t) n;
    return s;
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL TEXT OUTDIR\n", argv[0]);
        return 2;
    }
    g_out = argv[3];
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "dump-ffn: cannot load %s\n", argv[1]);
        return 1;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    size_t len;
    char * text = slurp(argv[2], &len);
    int n_max = (int) len + 16;
    llama_token * toks = malloc(sizeof(llama_token) * (size_t) n_max);
    int n_tok = llama_tokenize(vocab, text, (int32_t) len, toks, n_max, true, false);
    if (n_tok < 0) {
        fprintf(stderr, "dump-ffn: tokenizing failed\n");
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n_tok + 8;
    cp.n_batch = cp.n_ubatch = 512;
    cp.cb_eval = capture;
    cp.cb_eval_user_data = NULL;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "dump-ffn: cannot create a context of %d tokens\n", n_tok + 8);
        return 1;
    }
    for (int i = 0; i < n_tok; i += 512) {
        int n = n_tok - i < 512 ? n_tok - i : 512;
        if (llama_decode(ctx, llama_batch_get_one(toks + i, n)) != 0) {
            fprintf(stderr, "dump-ffn: decode failed at token %d\n", i);
            return 1;
        }
    }
    // The gate matrices, as floats.
    struct ggml_context * wctx = NULL;
    struct gguf_init_params gp = { .no_alloc = false, .ctx = &wctx };
    struct gguf_context * g = gguf_init_from_file(argv[1], gp);
    if (!g) {
        fprintf(stderr, "dump-ffn: cannot read %s\n", argv[1]);
        return 1;
    }
    int n_layer = llama_model_n_layer(model), n_embd = llama_model_n_embd(model), n_ff = 0;
    for (int il = 0; il < n_layer; il++) {
        char name[128];
        snprintf(name, sizeof name, "blk.%d.ffn_gate.weight", il);
        struct ggml_tensor * w = ggml_get_tensor(wctx, name);
        if (!w) {
            fprintf(stderr, "dump-ffn: no %s\n", name);
            return 1;
        }
        n_ff = (int) w->ne[1];
        size_t n = (size_t) ggml_nelements(w);
        float * out = malloc(n * sizeof(float));
        const struct ggml_type_traits * tt = ggml_get_type_traits(w->type);
        if (w->type == GGML_TYPE_F32) {
            memcpy(out, w->data, n * sizeof(float));
        } else if (tt->to_float) {
            tt->to_float(w->data, out, (int64_t) n);
        } else {
            fprintf(stderr, "dump-ffn: %s: type %s has no conversion\n", name, ggml_type_name(w->type));
            return 1;
        }
        char path[4096];
        snprintf(path, sizeof path, "%s/gate-%d.f32", g_out, il);
        FILE * f = fopen(path, "wb");
        fwrite(out, sizeof(float), n, f);
        fclose(f);
        free(out);
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/meta.txt", g_out);
    FILE * f = fopen(path, "w");
    fprintf(f, "%d %d %d %d\n", n_layer, n_embd, n_ff, n_tok);
    fclose(f);
    gguf_free(g);
    ggml_free(wctx);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
