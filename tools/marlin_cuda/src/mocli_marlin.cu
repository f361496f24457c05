/*
 * Modified by Neural Magic
 * Copyright (C) Marlin.2024 Elias Frantar
 *
 * Licensed under the Apache License, Version 2.0 (the "License");
 * you may not use this file except in compliance with the License.
 * You may obtain a copy of the License at
 *
 *         http://www.apache.org/licenses/LICENSE-2.0
 *
 * Unless required by applicable law or agreed to in writing, software
 * distributed under the License is distributed on an "AS IS" BASIS,
 * WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
 * See the License for the specific language governing permissions and
 * limitations under the License.
 */

/*
 * Adapted from https://github.com/IST-DASLab/marlin
 */

#ifndef MARLIN_NAMESPACE_NAME
  #define MARLIN_NAMESPACE_NAME marlin
#endif

#include "kernel.h"

// mocli: the torch includes and torch_utils.h are gone; STD_TORCH_CHECK comes from the shim in
// torch/headeronly/util/Exception.h (throws std::runtime_error).
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>

#define STATIC_ASSERT_SCALAR_TYPE_VALID(scalar_t)               \
  static_assert(std::is_same<scalar_t, half>::value ||          \
                    std::is_same<scalar_t, nv_bfloat16>::value, \
                "only float16 and bfloat16 is supported");

namespace marlin {

__global__ void MarlinDefault(MARLIN_KERNEL_PARAMS){};

using MarlinFuncPtr = void (*)(MARLIN_KERNEL_PARAMS);


// mocli: vLLM's '__CUDA_ARCH__ < 750' stub of marlin_gemm is dropped (this library is built for sm_90a only).

typedef struct {
  int thread_k;
  int thread_n;
  int num_threads;
} thread_config_t;

thread_config_t small_batch_thread_configs[] = {
    // Ordered by priority

    // thread_k, thread_n, num_threads
    {128, 128, 256},
    {64, 128, 128},
    {128, 64, 128}};

thread_config_t large_batch_thread_configs[] = {
    // Ordered by priority

    // thread_k, thread_n, num_threads
    {64, 256, 256},
    {64, 128, 128},
    {128, 64, 128}};

typedef struct {
  int blocks_per_sm;
  thread_config_t tb_cfg;
} exec_config_t;

int get_scales_cache_size(thread_config_t const& th_config, int prob_m,
                          int prob_n, int prob_k, int num_bits, int group_size,
                          int stages) {
  int tb_n = th_config.thread_n;
  int tb_k = th_config.thread_k;

  // Get max scale groups per thread-block
  int tb_groups;
  if (group_size == -1) {
    tb_groups = 1;
  } else {
    tb_groups = div_ceil(tb_k, group_size);
  }

  int tb_scales = tb_groups * tb_n * 2;
  return tb_scales * stages;
}

int get_kernel_cache_size(thread_config_t const& th_config, int thread_m_blocks,
                          int prob_m, int prob_n, int prob_k, int num_bits,
                          int group_size, int has_zp, bool is_zp_float,
                          bool is_a_8bit, int stages) {
  int pack_factor = 32 / num_bits;

  // Get B size
  int tb_k = th_config.thread_k;
  int tb_n = th_config.thread_n;
  int tb_m = thread_m_blocks * 16;
  int sh_a_size = stages * (tb_m * tb_k) * (is_a_8bit ? 1 : 2);
  int sh_b_size = stages * (tb_k * tb_n / pack_factor) * 4;
  int sh_red_size = tb_m * (tb_n + 8) * 2;
  int sh_bias_size = tb_n * 2;
  int tmp_size =
      (sh_b_size > sh_red_size ? sh_red_size : sh_b_size) + sh_bias_size;
  tmp_size = max(max(sh_b_size, sh_red_size), tmp_size);

  int sh_s_size = get_scales_cache_size(th_config, prob_m, prob_n, prob_k,
                                        num_bits, group_size, stages);
  int sh_zp_size = 0;
  if (has_zp) {
    if (is_zp_float)
      sh_zp_size = sh_s_size;
    else if (num_bits == 4)
      sh_zp_size = sh_s_size / 4;
    else if (num_bits == 8)
      sh_zp_size = sh_s_size / 2;
  }

  int total_size = tmp_size + sh_a_size + sh_s_size + sh_zp_size;

  return total_size;
}

bool is_valid_config(thread_config_t const& th_config, int thread_m_blocks,
                     int prob_m, int prob_n, int prob_k, int num_bits,
                     int group_size, int has_zp, bool is_zp_float,
                     bool is_a_8bit, int stages, int max_shared_mem) {
  // Sanity
  if (th_config.thread_k == -1 || th_config.thread_n == -1 ||
      th_config.num_threads == -1) {
    return false;
  }

  // Verify K/N are divisible by thread K/N
  if (prob_k % th_config.thread_k != 0 || prob_n % th_config.thread_n != 0) {
    return false;
  }

  // Verify min for thread K/N
  if (th_config.thread_n < min_thread_n || th_config.thread_k < min_thread_k) {
    return false;
  }

  // num_threads must be at least 128 (= 4 warps)
  if (th_config.num_threads < 128) {
    return false;
  }

  // Check that pipeline fits into cache
  int cache_size = get_kernel_cache_size(
      th_config, thread_m_blocks, prob_m, prob_n, prob_k, num_bits, group_size,
      has_zp, is_zp_float, is_a_8bit, stages);
  return cache_size <= max_shared_mem;
}

MarlinFuncPtr get_marlin_kernel(const vllm::ScalarType a_type,
                                const vllm::ScalarType b_type,
                                const vllm::ScalarType c_type,
                                const vllm::ScalarType s_type,
                                int thread_m_blocks, int thread_n_blocks,
                                int thread_k_blocks, bool m_block_size_8,
                                bool has_zp, int group_blocks, int threads,
                                bool is_zp_float, int stages) {
  int num_bits = b_type.size_bits();
  auto kernel = MarlinDefault;

  #include "kernel_selector.h"

  return kernel;
}

exec_config_t determine_exec_config(
    const vllm::ScalarType& a_type, const vllm::ScalarType& b_type,
    const vllm::ScalarType& c_type, const vllm::ScalarType& s_type, int prob_m,
    int prob_n, int prob_k, int thread_m_blocks, bool m_block_size_8,
    int num_bits, int group_size, bool has_zp, bool is_zp_float, int is_a_8bit,
    int stages, int max_shared_mem, int sms) {
  exec_config_t exec_cfg = exec_config_t{1, thread_config_t{-1, -1, -1}};
  thread_config_t* thread_configs = thread_m_blocks > 1
                                        ? large_batch_thread_configs
                                        : small_batch_thread_configs;
  int thread_configs_size =
      thread_m_blocks > 1
          ? sizeof(large_batch_thread_configs) / sizeof(thread_config_t)
          : sizeof(small_batch_thread_configs) / sizeof(thread_config_t);

  for (int i = 0; i < thread_configs_size; i++) {
    thread_config_t th_config = thread_configs[i];

    if (!is_valid_config(th_config, thread_m_blocks, prob_m, prob_n, prob_k,
                         num_bits, group_size, has_zp, is_zp_float, is_a_8bit,
                         stages, max_shared_mem - 512)) {
      continue;
    }

    int cache_size = get_kernel_cache_size(
        th_config, thread_m_blocks, prob_m, prob_n, prob_k, num_bits,
        group_size, has_zp, is_zp_float, is_a_8bit, stages);

    int group_blocks = group_size == -1 ? -1 : group_size / 16;

    auto kernel = get_marlin_kernel(
        a_type, b_type, c_type, s_type, thread_m_blocks,
        th_config.thread_n / 16, th_config.thread_k / 16, m_block_size_8,
        has_zp, group_blocks, th_config.num_threads, is_zp_float, stages);

    if (kernel == MarlinDefault) continue;

    return {1, th_config};
  }

  return exec_cfg;
}

void marlin_mm(const void* A, const void* B, void* C, void* C_tmp, void* b_bias,
               void* a_s, void* b_s, void* g_s, void* zp, int prob_m,
               int prob_n, int prob_k, int lda, void* workspace,
               vllm::ScalarType const& a_type, vllm::ScalarType const& b_type,
               vllm::ScalarType const& c_type, vllm::ScalarType const& s_type,
               bool has_bias, bool has_zp, int num_groups, int group_size,
               int dev, cudaStream_t stream, int thread_k_init,
               int thread_n_init, int sms, bool use_atomic_add,
               bool use_fp32_reduce, bool is_zp_float) {
  bool is_a_8bit = a_type.size_bits() == 8;
  STD_TORCH_CHECK(prob_m > 0 && prob_n > 0 && prob_k > 0, "Invalid MNK = [",
                  prob_m, ", ", prob_n, ", ", prob_k, "]");

  int group_blocks;
  if (group_size == -1) {
    group_blocks = -1;
  } else {
    group_blocks = group_size / 16;
    STD_TORCH_CHECK(prob_k % group_blocks == 0, "prob_k = ", prob_k,
                    " is not divisible by group_blocks = ", group_blocks);
  }

  int num_bits = b_type.size_bits();
  const int4* A_ptr = (const int4*)A;
  const int4* B_ptr = (const int4*)B;
  int4* C_ptr = (int4*)C;
  int4* C_tmp_ptr = (int4*)C_tmp;

  const int4* bias_ptr = (const int4*)b_bias;
  const float* a_s_ptr = (const float*)a_s;
  const int4* b_s_ptr = (const int4*)b_s;
  const float* g_s_ptr = (const float*)g_s;

  const int4* zp_ptr = (const int4*)zp;
  int* locks = (int*)workspace;

  int max_shared_mem = 0;
  cudaDeviceGetAttribute(&max_shared_mem,
                         cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  STD_TORCH_CHECK(max_shared_mem > 0);

  int major_capability, minor_capability;
  cudaDeviceGetAttribute(&major_capability, cudaDevAttrComputeCapabilityMajor,
                         dev);
  cudaDeviceGetAttribute(&minor_capability, cudaDevAttrComputeCapabilityMinor,
                         dev);
  STD_TORCH_CHECK(major_capability * 10 + minor_capability >= 75,
                  "marlin kernel only support Turing or newer GPUs.");
  int stages = 4;
  if (major_capability == 7 && minor_capability == 5) {
    stages = 2;
    STD_TORCH_CHECK(a_type == vllm::kFloat16 || a_type == vllm::kS8,
                    "Turing only support FP16 or INT8 activation.");
  }
  if (a_type == vllm::kFE4M3fn) {
    STD_TORCH_CHECK(major_capability * 10 + minor_capability >= 89,
                    "FP8 only support Ada Lovelace or newer GPUs.");
    STD_TORCH_CHECK(
        major_capability * 10 + minor_capability == 89 ||
            major_capability == 12,
        "Marlin W4A8-FP8 only support SM89 or SM12x device (It is slower than "
        "Marlin W4A16 on other devices).");
  }

  int max_par = 16;
  if (prob_n <= 4096) max_par = 16 * 8;
  int max_shared_mem_new = max_shared_mem;
  int rest_m = prob_m;
  int max_thread_m_blocks = 4;
  while (rest_m) {
    int par_count = rest_m / (max_thread_m_blocks * 16);
    if (par_count > max_par) par_count = max_par;
    int prob_m_split =
        par_count > 0 ? (par_count * (max_thread_m_blocks * 16)) : rest_m;

    int thread_k = thread_k_init;
    int thread_n = thread_n_init;

    int thread_m_blocks = min(div_ceil(prob_m_split, 16), max_thread_m_blocks);
    int m_block_size_8 = prob_m_split <= 8 && a_type.size_bits() == 16;

    // Set thread config
    exec_config_t exec_cfg;
    thread_config_t thread_tfg;
    if (thread_k != -1 && thread_n != -1) {
      thread_tfg = thread_config_t{thread_k, thread_n, default_threads};
      exec_cfg = exec_config_t{1, thread_tfg};
      STD_TORCH_CHECK(prob_n % thread_n == 0, "prob_n = ", prob_n,
                      " is not divisible by thread_n = ", thread_n);
      STD_TORCH_CHECK(prob_k % thread_k == 0, "prob_k = ", prob_k,
                      " is not divisible by thread_k = ", thread_k);
    } else {
      // Auto config
      exec_cfg = determine_exec_config(
          a_type, b_type, c_type, s_type, prob_m_split, prob_n, prob_k,
          thread_m_blocks, m_block_size_8, num_bits, group_size, has_zp,
          is_zp_float, is_a_8bit, stages, max_shared_mem, sms);
      thread_tfg = exec_cfg.tb_cfg;
      if (thread_tfg.thread_n != -1) {
        if (prob_n / thread_tfg.thread_n *
                div_ceil(prob_m_split, thread_m_blocks * 16) * 4 <=
            sms) {
          if (is_valid_config({128, 64, 128}, thread_m_blocks, prob_m_split,
                              prob_n, prob_k, num_bits, group_size, has_zp,
                              is_zp_float, is_a_8bit, stages,
                              max_shared_mem_new)) {
            thread_tfg = {128, 64, 128};
            exec_cfg = {1, thread_tfg};
          }
        }
      }

      if (thread_tfg.thread_k == -1 && max_thread_m_blocks > 1) {
        max_thread_m_blocks--;
        continue;
      }
    }

    int num_threads = thread_tfg.num_threads;
    thread_k = thread_tfg.thread_k;
    thread_n = thread_tfg.thread_n;
    int blocks = sms * exec_cfg.blocks_per_sm;
    if (exec_cfg.blocks_per_sm > 1)
      max_shared_mem_new = max_shared_mem / exec_cfg.blocks_per_sm - 1024;

    int thread_k_blocks = thread_k / 16;
    int thread_n_blocks = thread_n / 16;

    STD_TORCH_CHECK(
        is_valid_config(thread_tfg, thread_m_blocks, prob_m_split, prob_n,
                        prob_k, num_bits, group_size, has_zp, is_zp_float,
                        is_a_8bit, stages, max_shared_mem_new),
        "Invalid thread config: thread_m_blocks = ", thread_m_blocks,
        ", thread_k = ", thread_tfg.thread_k,
        ", thread_n = ", thread_tfg.thread_n,
        ", num_threads = ", thread_tfg.num_threads, " for MKN = [", prob_m,
        ", ", prob_k, ", ", prob_n, "] and num_bits = ", num_bits,
        ", prob_m_split = ", prob_m_split, ", group_size = ", group_size,
        ", has_zp = ", has_zp, ", is_zp_float = ", is_zp_float,
        ", stages = ", stages, ", max_shared_mem_new = ", max_shared_mem_new);

    auto kernel = get_marlin_kernel(
        a_type, b_type, c_type, s_type, thread_m_blocks, thread_n_blocks,
        thread_k_blocks, m_block_size_8, has_zp, group_blocks, num_threads,
        is_zp_float, stages);

    if (kernel == MarlinDefault) {
      STD_TORCH_CHECK(
          false, "Unsupported shapes: MNK = [", prob_m, ", ", prob_n, ", ",
          prob_k, "]", ", num_groups = ", num_groups,
          ", group_size = ", group_size, ", prob_m_split = ", prob_m_split,
          ", thread_m_blocks = ", thread_m_blocks,
          ", thread_n_blocks = ", thread_n_blocks,
          ", thread_k_blocks = ", thread_k_blocks,
          ", num_threads = ", num_threads, ", num_bits = ", num_bits);
    }

    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         max_shared_mem_new);

    bool part_use_atomic_add =
        use_atomic_add && div_ceil(prob_m_split, 64) * prob_n <= 2048;

    // avoid ">>>" being formatted to "> > >"
    // clang-format off
    kernel<<<blocks, num_threads, max_shared_mem_new, stream>>>(
        A_ptr, B_ptr, C_ptr, C_tmp_ptr, bias_ptr, a_s_ptr, b_s_ptr, g_s_ptr, zp_ptr,
        prob_m_split, prob_n, prob_k, lda, locks, has_bias, part_use_atomic_add,
        use_fp32_reduce, max_shared_mem_new);
    // clang-format on

    bool is_a_8bit = a_type.size_bits() == 8;
    A_ptr += prob_m_split * (lda / (is_a_8bit ? 16 : 8));
    a_s_ptr += prob_m_split;
    C_ptr += prob_m_split * (prob_n / 8);
    rest_m -= prob_m_split;
  }
}

}  // namespace marlin

// ---------------------------------------------------------------------------------------------
// mocli: the host entry. It replaces vLLM's torch wrapper `marlin_gemm(...)` (csrc/quantization/
// marlin/marlin.cu, the op behind torch.ops._C.marlin_gemm / vllm ops.marlin_gemm) for the one
// case mocli needs: BF16 activations, float4_e2m1f weights, no zero points, no activation scales.
// Tensors become raw device pointers plus the sizes the wrapper read from them; its checks are
// kept in the same order (those about a_scales / b_zeros / 8-bit activations drop out because the
// case cannot have them). Buffers it allocated with torch::stable::empty (c_tmp, and the empty
// placeholders, which are nullptr-like 0-element tensors) are cudaMalloc'ed here / passed as nullptr.
// ---------------------------------------------------------------------------------------------

namespace {
thread_local std::string mocli_last_error;

int mocli_fail(const std::string& what) {
  mocli_last_error = what;
  return 1;
}
}  // namespace

extern "C" {

// The message of the last failed call on this thread ("" after a success).
const char* mocli_marlin_last_error() { return mocli_last_error.c_str(); }

// Number of SMs of `device` (what marlin_gemm passes as `sms`; the workspace needs >= this many int32s).
int mocli_marlin_sms(int device) {
  int sms = -1;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

// y[size_m, size_n] (bf16, contiguous) = a[size_m, size_k] (bf16, row stride lda) x the Marlin weight.
//   b_q_weight: int32 [b_q_rows, b_q_cols] = [size_k/16, 2*size_n] contiguous (gptq_marlin_repack output)
//   b_scales:   [num_groups, scales_cols] contiguous, 1-byte elements; scale_type 0 = float8_e4m3fn
//               (NVFP4, group 16, needs global_scale), 1 = float8_e8m0fnu (MXFP4, group 32, no global)
//   global_scale: float32 (1 element) or nullptr;  b_bias: bf16 [size_n] or nullptr
//   workspace: int32 [workspace_numel], zeroed (Marlin resets its locks after each call)
//   stream: a cudaStream_t (torch.cuda.current_stream().cuda_stream) or nullptr for the default stream
// Returns 0, or 1 with mocli_marlin_last_error() set.
int mocli_marlin_gemm(const void* a, void* c, const void* b_q_weight, const void* b_scales,
                      const void* global_scale, const void* b_bias, void* workspace,
                      int64_t workspace_numel, int scale_type, int64_t size_m, int64_t size_n,
                      int64_t size_k, int64_t lda, int64_t b_q_rows, int64_t b_q_cols,
                      int64_t num_groups_in, int64_t scales_cols, int use_atomic_add,
                      int use_fp32_reduce, int device, void* stream) {
  mocli_last_error.clear();
  float* c_tmp = nullptr;
  try {
    vllm::ScalarType a_type = vllm::kBFloat16;  // a.scalar_type() == BFloat16
    vllm::ScalarType c_type = vllm::kBFloat16;
    vllm::ScalarType b_type = vllm::kFE2M1f;    // b_q_type_id = float4_e2m1f.id
    STD_TORCH_CHECK(scale_type == 0 || scale_type == 1,
                    "When b_type = float4_e2m1f, b_scale scalar type must be",
                    "float8_e4m3fn (for NVFP4) or float8_e8m0fnu (for MXFP4).");
    vllm::ScalarType s_type = scale_type == 0 ? vllm::kFE4M3fn : vllm::kFE8M0fnu;

    int pack_factor = 32 / b_type.size_bits();

    // Verify B
    STD_TORCH_CHECK(size_k % marlin::tile_size == 0, "size_k = ", size_k,
                    " is not divisible by tile_size = ", marlin::tile_size);
    STD_TORCH_CHECK((size_k / marlin::tile_size) == b_q_rows,
                    "Shape mismatch: b_q_weight.size(0) = ", b_q_rows, ", size_k = ", size_k,
                    ", tile_size = ", marlin::tile_size);
    STD_TORCH_CHECK(b_q_cols % marlin::tile_size == 0, "b_q_weight.size(1) = ", b_q_cols,
                    " is not divisible by tile_size = ", marlin::tile_size);
    int64_t actual_size_n = (b_q_cols / marlin::tile_size) * pack_factor;
    STD_TORCH_CHECK(size_n == actual_size_n, "size_n = ", size_n,
                    ", actual_size_n = ", actual_size_n);

    // Verify device and strides (A: stride(1) == 1 is the caller's contract)
    STD_TORCH_CHECK(lda % 8 == 0, "A.stride(0) must divisible by 8");
    STD_TORCH_CHECK(((uint64_t)a) % 16 == 0, "A must aligned to 16 bytes");

    int thread_k = -1;
    int thread_n = -1;
    int sms = mocli_marlin_sms(device);
    cudaSetDevice(device);  // DeviceGuard

    if (size_m == 0) return 0;

    // Alloc C tmp buffer that is going to be used for the global reduce
    if (use_fp32_reduce) {
      int max_m_block_size = (size_m + 16 - 1) / 16 * 16;
      max_m_block_size = min(max_m_block_size, 64);
      int max_c_tmp_size = sms * max_m_block_size * marlin::max_thread_n;
      cudaError_t e = cudaMalloc(&c_tmp, sizeof(float) * (size_t)max_c_tmp_size);
      STD_TORCH_CHECK(e == cudaSuccess, "cudaMalloc(c_tmp): ", cudaGetErrorString(e));
    }

    // Detect group size.
    int num_groups = -1;
    int group_size = -1;
    STD_TORCH_CHECK(scales_cols == size_n, "b_scales dim 1 = ", scales_cols,
                    " is not size_n = ", size_n);
    num_groups = (int)num_groups_in;
    if (num_groups > 1) {
      STD_TORCH_CHECK(size_k % num_groups == 0, "size_k = ", size_k,
                      ", is not divisible by b_scales.size(0) = ", num_groups);
      group_size = size_k / num_groups;
    } else {
      group_size = -1;
    }

    if (global_scale != nullptr) {
      STD_TORCH_CHECK(b_type == vllm::kFE2M1f && s_type == vllm::kFE4M3fn,
                      "global_scale can only be used for nvfp4 format.");
    } else {
      STD_TORCH_CHECK(!(b_type == vllm::kFE2M1f && s_type == vllm::kFE4M3fn),
                      "the global_scale parameter must be passed for nvfp4 format.");
    }
    bool has_bias = b_bias != nullptr;
    bool has_zp = false;
    bool is_zp_float = false;

    // Verify workspace size
    STD_TORCH_CHECK(size_n % marlin::min_thread_n == 0, "size_n = ", size_n,
                    ", is not divisible by min_thread_n = ", marlin::min_thread_n);
    int min_workspace_size = sms;
    STD_TORCH_CHECK(workspace_numel >= min_workspace_size, "workspace.numel = ",
                    workspace_numel, " is below min_workspace_size = ", min_workspace_size);

    marlin::marlin_mm(a, b_q_weight, c, c_tmp, const_cast<void*>(b_bias), nullptr,
                      const_cast<void*>(b_scales), const_cast<void*>(global_scale), nullptr,
                      size_m, size_n, size_k, lda, workspace, a_type, b_type, c_type, s_type,
                      has_bias, has_zp, num_groups, group_size, device, (cudaStream_t)stream,
                      thread_k, thread_n, sms, use_atomic_add != 0, use_fp32_reduce != 0,
                      is_zp_float);
    cudaError_t e = cudaGetLastError();
    STD_TORCH_CHECK(e == cudaSuccess, "kernel launch: ", cudaGetErrorString(e));
    if (c_tmp != nullptr) {
      e = cudaStreamSynchronize((cudaStream_t)stream);
      STD_TORCH_CHECK(e == cudaSuccess, "kernel run: ", cudaGetErrorString(e));
      cudaFree(c_tmp);
      c_tmp = nullptr;
    }
  } catch (const std::exception& ex) {
    if (c_tmp != nullptr) cudaFree(c_tmp);
    return mocli_fail(ex.what());
  }
  return 0;
}

}  // extern "C"
