/* A program that links -lllama, in the style of llama.cpp's examples/simple:
 * greedy text from a prompt, written to stdout, and "error: ..." with exit 1
 * where llama.cpp reports a failure. The context takes llama.cpp's defaults
 * (the model's context length, batches of 2048 and 512), as llama-completion
 * does. The tests build it against sdq's libllama.so and its headers
 * (target/release/{lib,include}).
 *
 * With GREEDY_RPC=HOST:PORT every layer goes to that rpc-server, as
 * `--rpc HOST:PORT -ngl 99` does in llama.cpp's tools.
 *
 * usage: greedy MODEL N_PREDICT PROMPT */
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The program's own log: llama.cpp's lines (and sdq's errors) on stderr,
 * each marked as the program's. */
static void log_line(enum ggml_log_level level, const char * text, void * data) {
    (void) data;
    fprintf(stderr, "log(%d): %s", (int) level, text);
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL N_PREDICT PROMPT\n", argv[0]);
        return 2;
    }
    const char * path = argv[1];
    const int n_predict = atoi(argv[2]);
    const char * prompt = argv[3];

    llama_log_set(log_line, NULL);
    ggml_backend_load_all();
    struct llama_model_params mparams = llama_model_default_params();
    const char * rpc = getenv("GREEDY_RPC");
    if (rpc) {
        /* as common's --rpc: the RPC backend's add_server, found by name */
        typedef ggml_backend_reg_t (*add_server_t)(const char * endpoint);
        ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
        add_server_t add_server = reg ? (add_server_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_add_server") : NULL;
        if (!add_server) {
            fprintf(stderr, "error: this libggml has no RPC backend\n");
            return 1;
        }
        ggml_backend_register(add_server(rpc));
        mparams.n_gpu_layers = 99;
    }
    struct llama_model * model = llama_model_load_from_file(path, mparams);
    if (model == NULL) {
        fprintf(stderr, "error: cannot load %s\n", path);
        return 1;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);

    const int n_prompt = -llama_tokenize(vocab, prompt, (int32_t) strlen(prompt), NULL, 0, true, true);
    llama_token * tokens = malloc(sizeof(llama_token) * (size_t) (n_prompt + n_predict + 1));
    if (llama_tokenize(vocab, prompt, (int32_t) strlen(prompt), tokens, n_prompt, true, true) < 0) {
        fprintf(stderr, "error: cannot tokenize the prompt\n");
        return 1;
    }

    struct llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = 0; /* the model's */
    /* One thread per online CPU, as llama-completion takes on this kind of
     * machine; the library's default (4) on fewer cores spins at ggml's
     * barriers. */
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    cparams.n_threads = cparams.n_threads_batch = (int32_t) (cpus > 0 ? cpus : 1);
    struct llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == NULL) {
        fprintf(stderr, "error: cannot create a context\n");
        return 1;
    }
    struct llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    struct llama_batch batch = llama_batch_get_one(tokens, n_prompt);
    for (int i = 0; i < n_predict; i++) {
        const int32_t rc = llama_decode(ctx, batch);
        if (rc != 0) {
            fprintf(stderr, "error: llama_decode returned %d\n", rc);
            return 1;
        }
        llama_token next = llama_sampler_sample(smpl, ctx, -1);
        if (llama_vocab_is_eog(vocab, next)) {
            break;
        }
        char piece[256];
        const int n = llama_token_to_piece(vocab, next, piece, sizeof(piece), 0, false);
        if (n < 0) {
            fprintf(stderr, "error: cannot convert token %d\n", next);
            return 1;
        }
        printf("%.*s", n, piece);
        fflush(stdout);
        tokens[n_prompt + i] = next;
        batch = llama_batch_get_one(&tokens[n_prompt + i], 1);
    }

    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    free(tokens);
    return 0;
}
