// The expert pool's ops: the masked row gather that fills its slots (CPU and CUDA), and its admit
// and grouped GEMM on the emulated device.
// A part of offtensor.cpp's one translation unit, included there once: every file that includes ATen
// costs about a minute to compile on a 2-core build machine, so the extension's ATen code stays one
// unit, kept in files by idea. Its functions have internal linkage (an unnamed namespace).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "ops_common.h"

namespace offtensor {
namespace {

// The expert pool's fetch (offtensor/ops/expert_pool.py): dst[dest[e]] = src[e] for every row e of
// src whose dest[e] is a slot of dst (0 <= dest[e] < dst.size(0)); other rows copy nothing. src is a
// host master (pinned: read by the GPU through its device address), dst a device buffer, dest an
// int64 tensor on dst's device. The CPU kernel is the emulated device's own gather.
void check_rows(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "offtensor: masked_row_gather needs contiguous ",
              "rows, got a ", dst.sizes(), " pool buffer and a ", src.sizes(), " host stack");
  TORCH_CHECK(dst.dtype() == src.dtype() && dst.dim() >= 1 && src.dim() == dst.dim() && src.size(0) > 0 &&
                  dst.numel() / std::max<int64_t>(dst.size(0), 1) == src.numel() / src.size(0),
              "offtensor: masked_row_gather: a ", src.sizes(), " ", src.dtype(), " stack does not fit a ",
              dst.sizes(), " ", dst.dtype(), " pool");
}

size_t row_bytes_of(const at::Tensor& src) { return static_cast<size_t>(src.numel() / src.size(0)) * src.element_size(); }

void check_gather(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& dest) {
  check_rows(dst, src);
  TORCH_CHECK(dest.dtype() == at::kLong && dest.dim() == 1 && dest.size(0) == src.size(0),
              "offtensor: masked_row_gather: dest must be int64 with one entry per row of the ", src.sizes(),
              " stack, got ", dest.sizes(), " ", dest.dtype());
}

void masked_row_gather_cpu(at::Tensor dst, const at::Tensor& src, const at::Tensor& dest, int64_t stream) {
  (void)stream;
  check_gather(dst, src, dest);
  const int64_t rows = src.size(0), slots = dst.size(0);
  const size_t row_bytes = row_bytes_of(src);
  const int64_t* to = dest.data_ptr<int64_t>();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* out = static_cast<char*>(dst.data_ptr());
  for (int64_t e = 0; e < rows; ++e) {
    const int64_t slot = to[e];
    if (slot >= 0 && slot < slots) std::memcpy(out + slot * row_bytes, from + e * row_bytes, row_bytes);
  }
}

#ifdef OFFTENSOR_WITH_CUDA
void masked_row_gather_cuda(at::Tensor dst, const at::Tensor& src, const at::Tensor& dest, int64_t stream) {
  check_gather(dst, src, dest);
  TORCH_CHECK(src.device().is_cpu(), "offtensor: masked_row_gather reads a host stack, got one on ", src.device());
  const size_t row_bytes = row_bytes_of(src);
  const int code = ot_cuda_masked_row_gather(dst.get_device(), dst.data_ptr(), src.data_ptr(),
                                             dest.data_ptr<int64_t>(), src.size(0), dst.size(0), row_bytes,
                                             reinterpret_cast<void*>(stream));
  TORCH_CHECK(code >= 0, "offtensor: masked_row_gather of a ", src.sizes(), " host stack failed: ",
              ot_cuda_error_string(-code), " (is the stack in pinned memory?)");
}
#endif

// The expert pool's admit on the emulated device, in one call, with the call's grouped-GEMM plan
// (offtensor/ops/expert_pool.py: pool_admit then _compact_plan are the same decisions as
// fixed-shape tensor ops, the form a GPU runs). `offs`: the cumulative group ends of a grouped GEMM
// of `rows` rows sorted by expert, of the layer whose `experts` experts start at `base` in slot_of.
// The experts with rows are admitted by LRU (protect the held ones; each missed one, in expert
// order, takes the unprotected slot of the oldest stamp, empty slots first, lowest index on ties),
// the missed ones copied from their host stacks into the slot buffers. Returns (each group's slot,
// the groups' ends), one group per distinct expert in expert order, min(rows, experts) groups.
// `counts` (fetches, hits) gains the missed and the held experts. All checks come before the first
// write, so the tables are never left half-changed.
std::tuple<at::Tensor, at::Tensor> pool_admit_cpu(const at::Tensor& offs, int64_t rows, at::Tensor slot_of,
                                                  at::Tensor expert_in, at::Tensor stamp, at::Tensor clock,
                                                  at::Tensor counts, at::TensorList buffers, at::TensorList hosts,
                                                  int64_t base, int64_t experts) {
  TORCH_CHECK(offs.dtype() == at::kInt && offs.is_contiguous() && offs.size(0) == experts,
              "offtensor: pool_admit takes int32 group ends, one per expert, got ", offs.sizes(), " ", offs.dtype());
  TORCH_CHECK(slot_of.dtype() == at::kLong && expert_in.dtype() == at::kLong && stamp.dtype() == at::kLong &&
                  clock.dtype() == at::kLong && counts.dtype() == at::kLong && counts.numel() == 2 &&
                  counts.is_contiguous() && slot_of.is_contiguous() && expert_in.is_contiguous() &&
                  stamp.is_contiguous() && buffers.size() == hosts.size(),
              "offtensor: pool_admit takes contiguous int64 tables and one host stack per buffer");
  const int64_t slots = expert_in.size(0) - 1, total = slot_of.size(0) - 1;
  TORCH_CHECK(base >= 0 && base + experts <= total && stamp.size(0) == slots + 1,
              "offtensor: pool_admit: a layer of ", experts, " experts at ", base, " does not fit a table of ", total);
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_rows(buffers[i], hosts[i]);
    TORCH_CHECK(hosts[i].size(0) == experts && buffers[i].size(0) == slots,
                "offtensor: pool_admit: a ", hosts[i].sizes(), " stack for a layer of ", experts, " experts and ",
                slots, " slots");
  }
  const int32_t* ends = offs.data_ptr<int32_t>();
  int64_t* slot = slot_of.data_ptr<int64_t>() + base;
  int64_t* holder = expert_in.data_ptr<int64_t>();
  int64_t* last = stamp.data_ptr<int64_t>();
  std::vector<char> needed(experts, 0), guarded(slots, 0);
  int64_t misses = 0, hits = 0, previous = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t end = std::min<int64_t>(ends[e], rows);
    needed[e] = end > previous;
    previous = std::max(previous, end);
    if (!needed[e]) continue;
    if (slot[e] >= 0) guarded[slot[e]] = 1, ++hits; else ++misses;
  }
  std::vector<int64_t> free_slots;
  for (int64_t s = 0; s < slots; ++s)
    if (!guarded[s]) free_slots.push_back(s);
  TORCH_CHECK(misses <= static_cast<int64_t>(free_slots.size()), "offtensor: pool_admit: ", misses,
              " missed experts for ", free_slots.size(), " free slots");
  std::stable_sort(free_slots.begin(), free_slots.end(), [&](int64_t a, int64_t b) { return last[a] < last[b]; });
  std::vector<int64_t> dest(experts, slots);
  int64_t rank = 0;
  for (int64_t e = 0; e < experts; ++e)
    if (needed[e] && slot[e] < 0) dest[e] = free_slots[rank++];
  for (int64_t e = 0; e < experts; ++e) {  // 1. the taken slots leave their old experts
    if (dest[e] == slots) continue;
    const int64_t old = holder[dest[e]];
    if (old >= 0) slot_of.data_ptr<int64_t>()[old] = -1;
    holder[dest[e]] = -1;
  }
  for (size_t i = 0; i < buffers.size(); ++i) {  // 2. the missed experts' bytes
    const size_t row_bytes = row_bytes_of(hosts[i]);
    const char* from = static_cast<const char*>(hosts[i].data_ptr());
    char* to = static_cast<char*>(buffers[i].data_ptr());
    for (int64_t e = 0; e < experts; ++e)
      if (dest[e] < slots) std::memcpy(to + dest[e] * row_bytes, from + e * row_bytes, row_bytes);
  }
  const int64_t now = clock.data_ptr<int64_t>()[0];
  const int64_t groups = std::min(rows, experts);
  at::Tensor group_slot = at::zeros({groups}, slot_of.options());
  at::Tensor group_ends = at::empty({groups}, offs.options());
  int64_t* gs = group_slot.data_ptr<int64_t>();
  int32_t* ge = group_ends.data_ptr<int32_t>();
  int64_t group = 0;
  int32_t covered = 0;
  for (int64_t e = 0; e < experts; ++e) {  // 3. slots to their new experts, experts to their slots
    if (dest[e] < slots) {
      holder[dest[e]] = base + e;
      slot[e] = dest[e];
    }
    if (!needed[e]) continue;
    last[slot[e]] = now;
    covered = static_cast<int32_t>(std::min<int64_t>(ends[e], rows));
    gs[group] = slot[e];
    ge[group++] = covered;
  }
  for (; group < groups; ++group) ge[group] = covered;
  clock.data_ptr<int64_t>()[0] = now + 1;
  counts.data_ptr<int64_t>()[0] += misses;
  counts.data_ptr<int64_t>()[1] += hits;
  return std::make_tuple(group_slot, group_ends);
}

// The emulated device's grouped GEMM of a pooled call (offtensor/ops/expert_pool.py), with no copy of
// the slots it reads: group g (rows [ends[g-1], ends[g])) against slot group_slot[g] of `pool` (the
// pool's buffer in the layout the op passed the stack in). Each group is the at::mm_out that
// aten's CPU _grouped_mm runs for it, on the same row slice and a matrix of the same strides, so the
// rows are bit-identical to the plain model's call; rows past the last group end are left as they
// are, as there. `ends` and `group_slot` are read on the host (they live there on this device).
at::Tensor pool_grouped_mm_cpu(const at::Tensor& x, const at::Tensor& pool, const at::Tensor& group_slot,
                               const at::Tensor& ends) {
  TORCH_CHECK(x.dim() == 2 && pool.dim() == 3 && x.size(1) == pool.size(1) && x.scalar_type() == pool.scalar_type(),
              "offtensor: pool_grouped_mm takes (rows, k) rows and (slots, k, n) slots of one dtype, got ", x.sizes(),
              " ", x.dtype(), " and ", pool.sizes(), " ", pool.dtype());
  TORCH_CHECK(ends.dtype() == at::kInt && group_slot.dtype() == at::kLong && ends.is_contiguous() &&
                  group_slot.is_contiguous() && ends.numel() == group_slot.numel(),
              "offtensor: pool_grouped_mm takes int32 group ends and one int64 slot per group");
  const int64_t groups = ends.numel(), slots = pool.size(0), rows = x.size(0);
  const int32_t* end = ends.data_ptr<int32_t>();
  const int64_t* slot = group_slot.data_ptr<int64_t>();
  for (int64_t g = 0, start = 0; g < groups; start = end[g++])  // all checks before the first GEMM
    TORCH_CHECK(end[g] >= start && end[g] <= rows && slot[g] >= 0 && slot[g] < slots,
                "offtensor: pool_grouped_mm: group ", g, " ends at ", end[g], " of ", rows, " rows in slot ", slot[g],
                " of ", slots);
  at::Tensor out = at::empty({rows, pool.size(2)}, x.options());
  for (int64_t g = 0, start = 0; g < groups; start = end[g++])
    if (end[g] > start) {
      at::Tensor rows_out = out.slice(0, start, end[g]);
      at::mm_out(rows_out, x.slice(0, start, end[g]), pool.select(0, slot[g]));
    }
  return out;
}

}  // namespace
}  // namespace offtensor
