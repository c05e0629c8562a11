#include "../tool-entry.h"
SDQ_TOOL_ENTRY(batched_bench)
