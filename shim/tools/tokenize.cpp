#include "../tool-entry.h"
SDQ_TOOL_ENTRY_NAMED(tokenize, llama_tokenize_tool)
