// The compiled CPU kernels, one Python module (kernels/cpu_ops.py builds it).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_starts,
                              int64_t block_size, double scale, int64_t kv_format, int64_t sinks, int64_t window);
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor weight);
bool small_batch_linear_supported();
torch::Tensor small_batch_linear_int8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Attention of short query spans over a paged KV cache (CPU)");
  m.def("small_batch_linear", &small_batch_linear, "x W^T for 1-8 bfloat16 rows (AVX-512 BF16)");
  m.def("small_batch_linear_int8", &small_batch_linear_int8, "(x qweight^T) * scales for 1-8 bfloat16 rows, int8 weights");
  m.def("small_batch_linear_supported", &small_batch_linear_supported, "Whether small_batch_linear was compiled in");
}
