#include "../tool-entry.h"
SDQ_TOOL_ENTRY_CONST_ARGV(gguf_split, llama_gguf_split)
