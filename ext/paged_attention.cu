// Placeholder: the kernels of this file are being written (see engine/ops.py).
#include <torch/extension.h>

#include "trellis_ext.h"

namespace trellis {
void bind_paged_attention(pybind11::module_& m) { (void)m; }
}  // namespace trellis
