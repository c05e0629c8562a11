#include "../tool-entry.h"
SDQ_TOOL_ENTRY_NAMED(test_llama_archs, llama_test_llama_archs)
