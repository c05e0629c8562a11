#include "../tool-entry.h"
SDQ_TOOL_ENTRY_NAMED(rpc_server, llama_rpc_server)
