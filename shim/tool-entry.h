// C entry points for the llama.cpp tools. Each tool's entry (one file per tool
// under tools/, so a binary links only its own tool) calls upstream's entry
// function -- the body of its three-line main -- and keeps C++ exceptions from
// crossing into Rust.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>

// common/log.h: the tools log through a worker thread whose queue the pinned
// tree never drains at exit (its singleton is leaked on purpose), so a tool's
// last error line could be lost when it exits right after. Found as a missing
// "mismatch" line of llama-mtmd-cli in a CI run.
struct common_log;
struct common_log * common_log_main();
void common_log_flush(struct common_log * log);

static void sdq_flush_log() {
    common_log_flush(common_log_main());
}

template <int (*Entry)(int, char **)>
static int sdq_guarded(int argc, char ** argv) {
    // Also at exit(), which tools call from inside (--help, bad arguments).
    std::atexit(sdq_flush_log);
    try {
        return Entry(argc, argv);
    } catch (const std::exception & e) {
        // Upstream's main would terminate on an escaping exception; exit non-zero with its message instead.
        std::fprintf(stderr, "%s: error: %s\n", argc > 0 ? argv[0] : "llama", e.what());
        return 1;
    } catch (...) {
        std::fprintf(stderr, "%s: error: unknown exception\n", argc > 0 ? argv[0] : "llama");
        return 1;
    }
}

// SDQ_TOOL_ENTRY(cli) defines `int sdq_tool_cli(int, char **)` calling upstream's `llama_cli`.
#define SDQ_TOOL_ENTRY(name)                                              \
    int llama_##name(int argc, char ** argv);                             \
    extern "C" int sdq_tool_##name(int argc, char ** argv) {              \
        return sdq_guarded<llama_##name>(argc, argv);                     \
    }

// The same for a tool whose upstream `main` takes `const char ** argv`
// (llama-gguf-split): compiled with `main` renamed to `entry`.
#define SDQ_TOOL_ENTRY_CONST_ARGV(name, entry)                            \
    int entry(int argc, const char ** argv);                              \
    static int sdq_##name##_adapter(int argc, char ** argv) {             \
        return entry(argc, const_cast<const char **>(argv));              \
    }                                                                     \
    extern "C" int sdq_tool_##name(int argc, char ** argv) {              \
        return sdq_guarded<sdq_##name##_adapter>(argc, argv);             \
    }

// The same for a tool whose renamed `main` is called `entry` (its own name
// would clash with the library, e.g. llama_tokenize).
#define SDQ_TOOL_ENTRY_NAMED(name, entry)                                 \
    int entry(int argc, char ** argv);                                    \
    extern "C" int sdq_tool_##name(int argc, char ** argv) {              \
        return sdq_guarded<entry>(argc, argv);                            \
    }
