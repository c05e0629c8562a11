#include "../tool-entry.h"
SDQ_TOOL_ENTRY(imatrix)
