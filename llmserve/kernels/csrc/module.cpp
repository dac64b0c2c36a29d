// The compiled CPU kernels, one Python module (kernels/cpu_ops.py builds it).
#include <torch/extension.h>

#include "decode_stack.h"
#include "draft_head.h"
#include "kernels.h"
#include "shm_collectives.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Attention of short query spans over a paged KV cache (CPU)",
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("query_starts"), pybind11::arg("block_size"), pybind11::arg("scale"),
        pybind11::arg("kv_format"), pybind11::arg("sinks"), pybind11::arg("window"),
        pybind11::arg("tree_masks") = std::nullopt);
  m.def("paged_attention_low_bit", &paged_attention_low_bit,
        "Decode attention over an int4/int2 KV cache with its full-precision windows and sinks (CPU)");
  m.def("paged_attention_low_bit_supported", &paged_attention_low_bit_supported,
        "Whether paged_attention_low_bit takes this query dtype and head_dim here");
  m.def("quantize_low_bit_blocks", &quantize_low_bit_blocks,
        "Whole blocks of K and V into int4/int2 rows, as attention/kv_format.py lays them out (CPU)");
  m.def("paged_attention_path", &paged_attention_path,
        "Which paged_attention kernel runs for this query dtype, kv_format and head_dim here: bf16_pairs, fma "
        "or portable",
        py::arg("dtype"), py::arg("kv_format"), py::arg("head_dim"));
  m.def("prefill_attention", &prefill_attention,
        "Causal attention of a long prompt span over its paged context (bf16 or float32); use_amx: bf16 on "
        "AMX's tile products where the CPU has them",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("context_slots"), py::arg("scale"),
        py::arg("use_amx") = true);
  m.def("prefill_attention_amx_supported", &prefill_attention_amx_supported,
        "Whether bf16 prefill_attention runs on AMX here");
  m.def("lora_delta", &lora_delta,
        "Each row's LoRA delta added in place: out[t] += (A[s] x[t]) Bt[s], s = token_slots[t] (-1: none)");
  m.def("lora_delta_supported", &lora_delta_supported, "Whether lora_delta was compiled in (AVX2 and FMA)");
  m.def("prefill_attention_supported", &prefill_attention_supported, "Whether prefill_attention takes this dtype here");
  m.def("prefill_attention_path", &prefill_attention_path,
        "Which prefill_attention kernel runs for this dtype here: amx, avx512_bf16, fma or ''");
  m.def("small_batch_pack", &small_batch_pack, "A bf16 weight [N, K] in the layout small_batch_linear reads");
  m.def("small_batch_linear", &small_batch_linear,
        "x W^T for 1-8 bfloat16 rows, W packed (AVX-512 BF16, or float32 FMAs on AVX2)");
  m.def("small_batch_linear_float_out", &small_batch_linear_float_out,
        "x W^T for any number of bfloat16 rows, W packed, float32 out (the logits)");
  m.def("amx_linear", &amx_linear, "x W^T (+ bias) for any number of bfloat16 rows, W packed by small_batch_pack, on AMX",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("float_out") = false);
  m.def("amx_linear_supported", &amx_linear_supported, "Whether amx_linear runs here (AMX BF16, permitted)");
  m.def("small_batch_pack_f32", &small_batch_pack_f32, "A float32 weight [N, K] in the layout small_batch_linear_f32 reads");
  m.def("small_batch_linear_f32", &small_batch_linear_f32, "x W^T for 1-8 float32 rows, W packed (AVX2 and FMA)");
  m.def("small_batch_linear_f32_supported", &small_batch_linear_f32_supported,
        "Whether small_batch_linear_f32 was compiled in");
  m.def("small_batch_pack_int8", &small_batch_pack_int8, "int8 codes [N, K] in the layout small_batch_linear_int8 reads");
  m.def("small_batch_pack_int8_group_scales", &small_batch_pack_int8_group_scales,
        "int8 scales per (row, 32 columns) in the layout small_batch_linear_int8 reads");
  m.def("small_batch_linear_int8", &small_batch_linear_int8,
        "(x qweight^T) * scales for 1-8 bfloat16 rows, float32 too on AVX2 (8-bit inputs per 32 columns)");
  m.def("small_batch_linear_int8_float_out", &small_batch_linear_int8_float_out,
        "small_batch_linear_int8 for any number of rows, float32 out (a quantized output projection)");
  m.def("small_batch_pack_int4", &small_batch_pack_int4,
        "int4 codes (bits 5: 5-bit codes), scales, offsets in the layout small_batch_linear_int4 reads",
        py::arg("codes"), py::arg("scales"), py::arg("offsets"), py::arg("bits") = 4);
  m.def("small_batch_linear_int4", &small_batch_linear_int4,
        "x W^T for 1-8 bfloat16 rows, float32 too on AVX2, W int4 in groups (8-bit inputs per 32 columns)");
  m.def("grouped_linear_int8", &grouped_linear_int8,
        "small_batch_linear_int8 over a mixture-of-experts layer: rows [ends[e-1], ends[e]) against expert e's weights");
  m.def("grouped_linear_int4", &grouped_linear_int4,
        "small_batch_linear_int4 over a mixture-of-experts layer: rows [ends[e-1], ends[e]) against expert e's weights");
  m.def("moe_combine", &moe_combine,
        "Per token, the float32 sum of its (token, expert) pairs' rows times their weights, rounded once");
  m.def("moe_experts", &moe_experts,
        "A mixture-of-experts layer's int8/int4 experts in one call: sort pairs, gather, grouped gate/up, "
        "silu_and_mul, grouped down, combine; pairs routed outside the held experts [first_expert, +E) skipped");
  m.def("small_batch_dequantize_int4", &small_batch_dequantize_int4,
        "The float32 W [N, K] of an int4 (bits 5: 5-bit) weight packed by small_batch_pack_int4 (its one copy); "
        "with rows, only those rows",
        py::arg("packed"), py::arg("params"), py::arg("out_features"), py::arg("bits") = 4,
        py::arg("rows") = py::none());
  m.def("small_batch_dequantize_int8", &small_batch_dequantize_int8,
        "The float32 W [N, K] of an int8 weight packed by small_batch_pack_int8 with its scales; with rows, only "
        "those rows",
        py::arg("packed"), py::arg("scales"), py::arg("out_features"), py::arg("rows") = py::none());
  m.def("small_batch_linear_int8_supported", &small_batch_linear_int8_supported,
        "Whether the int8 and int4 small-batch kernels were compiled in for inputs of this dtype",
        py::arg("input_dtype") = at::kBFloat16);
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, float32 inside");
  m.def("add_rms_norm", &add_rms_norm, "x += residual in place; returns RMSNorm(x)");
  m.def("rotary_embedding", &rotary_embedding, "Rotate-half RoPE of query and key rows, in place");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up of a fused [gate | up] projection");
  m.def("write_kv_rows", &write_kv_rows, "cache[slots[i]] = rows[i], a memcpy per token");
  m.def("greedy_sample", &greedy_sample, "Each row's argmax (the first of equal maxima), rows shared among threads");
  m.def("set_omp_thread_cpus", &set_omp_thread_cpus, "OpenMP thread t may run only on the CPUs of entry t");
  pybind11::class_<DecodeStack>(m, "DecodeStack", "A model's decoder layers for a decode-only step, one call")
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                          int64_t, int64_t, double, double, int64_t, int64_t, int64_t>())
      .def("forward", &DecodeStack::forward, pybind11::arg("hidden"), pybind11::arg("positions"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
           pybind11::arg("query_starts"), pybind11::arg("block_size"), pybind11::arg("sinks"), pybind11::arg("window"),
           pybind11::arg("token_slots") = std::nullopt, pybind11::arg("tree_masks") = std::nullopt)
      .def("set_lora", &DecodeStack::set_lora)
      .def("one_region_calls", &DecodeStack::one_region_calls)
      .def("set_shm_all_reduce",
           [](DecodeStack& stack, std::shared_ptr<ShmCollectives> shm) {
             stack.set_all_reduce([shm](torch::Tensor t) { shm->all_reduce(t); });
           })
      .def("set_python_all_reduce", [](DecodeStack& stack, pybind11::function all_reduce) {
        // across hosts: the group's gloo all-reduce, called back with the GIL the forward holds
        stack.set_all_reduce([all_reduce](torch::Tensor t) { all_reduce(t); });
      });
  pybind11::class_<ShmCollectives, std::shared_ptr<ShmCollectives>>(
      m, "ShmCollectives", "All-reduce and gather between tensor-parallel ranks on one host, in shared memory")
      .def(pybind11::init<const std::string&, int64_t, int64_t, int64_t, double, bool>())
      .def("all_reduce", &ShmCollectives::all_reduce)
      .def("gather_to_first", &ShmCollectives::gather_to_first)
      .def_property_readonly("slot_bytes", &ShmCollectives::slot_bytes);
  pybind11::class_<DraftHeadChain>(m, "DraftHeadChain", "A draft head's greedy drafting steps, one call")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, torch::Tensor, int64_t, double>())
      .def("greedy", &DraftHeadChain::greedy);
  m.def("small_batch_linear_supported", &small_batch_linear_supported, "Whether small_batch_linear was compiled in");
}
